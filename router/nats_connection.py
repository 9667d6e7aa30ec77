"""One way to reach NATS for the event bus and the load bus: a connection that reconnects forever, whose
first connect is retried too (the bus may start after the router, or be down when it starts), with the
credentials and TLS of ``NatsAuth``. A server that refuses us (wrong credentials, a permission we lack, a TLS
handshake that fails) is logged as an error, once per distinct refusal, naming what to check; the caller
keeps running on what it has (routers: load-only routing; a relay: its outbox)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NatsAuth:
    """How a client proves itself to nats-server: one of user/password, a token, an nkey seed file or a
    ``.creds`` file (JWT and seed, operator mode), and optionally TLS (a CA to verify the server, a client
    certificate for mutual TLS). Secrets may be given as files (a mounted Kubernetes Secret) instead of
    inline; inline secrets are kept out of ``repr``. Each field is handed to nats-py's ``connect`` as is."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    nkeys_seed: str | None = None  # a file holding the user's nkey seed (SU...)
    creds_file: str | None = None  # a NATS .creds file (user JWT + seed)
    tls_ca: str | None = None  # PEM CA bundle the server's certificate must chain to
    tls_cert: str | None = None  # PEM client certificate (mutual TLS); its key in tls_key (or in the same file)
    tls_key: str | None = None
    tls_hostname: str | None = None  # the name the server's certificate must carry, if not the URL's host

    @property
    def configured(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def check(self) -> None:
        """``ValueError`` naming the field when the settings cannot work (checked at start, not at connect)."""
        if self.password is not None and self.password_file is not None:
            raise ValueError("give password or password_file, not both")
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")
        has_password = self.password is not None or self.password_file is not None
        if has_password and not self.user:
            raise ValueError("password needs user")
        methods = [name for name, on in (("user", self.user is not None), ("token", self.token is not None or
                   self.token_file is not None), ("nkeys_seed", self.nkeys_seed is not None),
                   ("creds_file", self.creds_file is not None)) if on]
        if len(methods) > 1:
            raise ValueError(f"give one way to authenticate, not {' and '.join(methods)}")
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("tls_key needs tls_cert")
        for name in ("password_file", "token_file", "nkeys_seed", "creds_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")
        if self.nkeys_seed is not None or self.creds_file is not None:
            try:
                import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
            except ImportError:
                raise ValueError("nkeys_seed and creds_file need the nkeys package (pip install nkeys)") from None

    def options(self) -> dict[str, Any]:
        """nats-py ``connect`` keyword arguments; secret files are read now (a rotated Secret is read again at
        the next start)."""
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts["user"] = self.user
        password = self.password if self.password_file is None else _read_secret(self.password_file)
        if password is not None:
            opts["password"] = password
        token = self.token if self.token_file is None else _read_secret(self.token_file)
        if token is not None:
            opts["token"] = token
        if self.nkeys_seed is not None:
            opts["nkeys_seed"] = self.nkeys_seed
        if self.creds_file is not None:
            opts["user_credentials"] = self.creds_file
        if self.tls_ca is not None or self.tls_cert is not None:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert is not None:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            opts["tls"] = ctx
        if self.tls_hostname is not None:
            opts["tls_hostname"] = self.tls_hostname
        return opts


OnError = Callable[[BaseException, "str | None"], None]  # an error the client reported, and its refusal text


def _read_secret(path: str) -> str:
    return Path(path).read_text().strip()


def refusal(e: BaseException) -> str | None:
    """What a server refusing us means, for an operator; None for an ordinary outage (down, restarting)."""
    from nats import errors

    text = str(e) or type(e).__name__
    if isinstance(e, errors.AuthorizationError) or "authorization violation" in text.lower():
        return ("authorization violation: the server refused our credentials (user/password, token, nkey or "
                "creds file; see events_bus_auth / --bus-* in docs/event-bus.md)")
    if "permissions violation" in text.lower():
        return f"{text.removeprefix('nats: ')} (the account's permissions do not allow it; docs/event-bus.md)"
    if isinstance(e, ssl.SSLError | errors.SecureConnRequiredError | errors.SecureConnWantedError |
                  errors.SecureConnFailedError):
        return f"TLS: {text} (check tls_ca / tls_cert / tls_key and the URL's scheme, tls://)"
    if "authentication" in text.lower() or "credentials" in text.lower():
        return text
    return None


async def connect_nats(url: str, name: str, *, retry_s: float = 0.5, while_down: str = "retrying",
                       auth: NatsAuth | None = None, on_error: OnError | None = None,
                       **options: Any) -> Any:
    """``while_down``: what the caller does meanwhile, for the log line; ``auth``: credentials and TLS;
    ``on_error``: told every error the client reports with its ``refusal`` text (None: an ordinary outage);
    ``options``: nats.connect's own."""
    import nats

    logged: list[str] = []  # the refusal last logged: each distinct one once, not at every retry

    async def _error(e: Exception) -> None:
        why = refusal(e)
        if on_error is not None:
            on_error(e, why)
        if why is None:
            log.debug("nats %s: %r", name, e)
        elif logged != [why]:
            logged[:] = [why]
            log.error("NATS %s refused %s: %s; %s", url, name, why, while_down)

    if auth is not None:
        options = {**auth.options(), **options}
    while True:
        try:
            return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=retry_s,
                                      connect_timeout=2, allow_reconnect=True, error_cb=_error, **options)
        except Exception as e:  # no servers yet: keep trying, as a reconnect would
            why = refusal(e)
            if on_error is not None:
                on_error(e, why)
            log.warning("NATS %s not reachable (%s): %s", url, why or repr(e), while_down)
            await asyncio.sleep(retry_s)
