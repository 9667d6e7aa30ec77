"""One YAML file for the router, validated with clear errors, then ``KVROUTER_...`` environment variables, then
command-line overrides (file < environment < options).

Every key has a default; unknown keys and wrong types are errors naming the key (or the variable).
``kvrouter serve --help`` lists the overrides; ``docs/configuration.md`` documents the file and the variables.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import secrets
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.discovery import WorkerSpec, parse_worker_arg
from router.discovery.static import _spec
from router.nats_connection import NatsAuth
from router.scheduling import CostParams, RoutingConfig, SchedulingConfig
from router.scheduling.engine_profile import read_timing_file
from router.scheduling.flow import FlowParams, parse_flow_params
from router.scheduling.profiles import ProfileError, build_profile, parse_scheduling
from router.scheduling.slo import ObjectiveError, SloConfig, parse_slo_config
from router.tokenizer import DEFAULT_TOKENIZER_DIR

log = logging.getLogger("kvrouter.config")


class ConfigError(ValueError):
    pass


@dataclass
class Listen:
    host: str = "0.0.0.0"
    port: int = 8000


@dataclass
class HttpServerSettings:
    """The proxy's client connections (router/frontends/http1.py); the timeouts are nginx's defaults."""

    header_read_timeout_s: float = 60.0  # request line and headers, from the request's first byte (408 after);
    #                                      also how long a new connection may send nothing (closed after)
    body_read_timeout_s: float = 60.0  # between two reads of a request's body (408 after)
    keepalive_timeout_s: float = 75.0  # a kept-alive connection with no request begun is closed after this
    max_connections: int = 10000  # client connections open at once; past it a new one is answered 503 and closed
    # on SIGTERM/SIGINT (docs/configuration.md, "Shutdown"): requests in flight, streams included, get this long to
    # finish before their connections are cut (keep it below Kubernetes' terminationGracePeriodSeconds)
    grace_s: float = 10.0


@dataclass
class Admin:
    host: str = "127.0.0.1"  # admin and debug endpoints are not open to the world by default
    port: int = 8001


@dataclass
class EppSettings:
    """The endpoint picker's ports, by the Gateway API Inference Extension's conventions."""

    host: str = "0.0.0.0"
    port: int = 9002  # ext_proc gRPC
    health_port: int = 9003  # gRPC health: liveness, readiness, the ext_proc service name
    metrics_host: str = "0.0.0.0"  # Prometheus scrapes it from inside the cluster
    metrics_port: int = 9090
    fallbacks: int = 2  # endpoints after the pick in the envoy.lb list
    grace_s: float = 10.0  # on shutdown, open streams get this long to finish
    # the ext_proc port's gRPC server: "kvrouter", HTTP/2 on asyncio protocols (router/frontends/h2grpc.py, a
    # third of grpc.aio's CPU per pick); "grpcio", grpc.aio (gRPC's own C core), should a gateway's client need it
    grpc_server: str = "kvrouter"
    # the ext_proc port's HTTP/2 connections (the kvrouter server; grpcio has its own): grpc-go's handshake
    # timeout, Envoy's downstream idle timeout
    handshake_timeout_s: float = 120.0  # the client's preface and first SETTINGS must arrive within this
    idle_timeout_s: float = 3600.0  # a connection with no open stream for this long gets GOAWAY and is closed
    max_connections: int = 10000  # connections open at once; past it a new one is closed at once
    # the fleet's admin (GET /admin/workers, POST /admin/drain and /admin/undrain) on admin.host at this port;
    # unset: none (the proxy's admin.port is 8001 by default: a picker beside it on one host must not take it)
    admin_port: int | None = None
    # kvrouter.v1.Picker/Rank (router/frontends/rank.py) on admin.host at this port; unset: not served at all. Never
    # on the ext_proc port: Rank reports the blocks cached per worker for any cache_salt it is given, an oracle on
    # other tenants' prompts to whoever can reach it
    rank_port: int | None = None


@dataclass
class KubernetesSettings:
    """Discover workers as the pods of an InferencePool (router/discovery/kubernetes.py)."""

    namespace: str = "default"
    pool: str | None = None  # InferencePool name; unset: no Kubernetes discovery
    events_by_default: bool = True  # pods without the kv-events annotation publish on :5557
    kubeconfig: str | None = None  # outside the cluster; in it, the pod's service account is used


@dataclass
class RouterConfig:
    listen: Listen = field(default_factory=Listen)
    admin: Admin = field(default_factory=Admin)
    http: HttpServerSettings = field(default_factory=HttpServerSettings)
    epp: EppSettings = field(default_factory=EppSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)  # plugins and profiles (versioned)
    slo: SloConfig = field(default_factory=SloConfig)  # named objectives, per model and tenant (docs/slo.md)
    flow_control: FlowParams = field(default_factory=FlowParams)  # hold requests while saturated (docs/slo.md)
    workers: list[WorkerSpec] = field(default_factory=list)
    workers_file: str | None = None
    events_bind: str | None = None  # bind one SUB socket that engines connect to (topic names the worker)
    events_bus: str | None = None  # nats://...: KV events from relays on NATS JetStream (docs/event-bus.md)
    # the credentials and TLS the router presents to events_bus: user/password, token, nkeys_seed or creds_file,
    # tls_ca/tls_cert/tls_key (docs/event-bus.md); secrets inline (KVROUTER_EVENTS_BUS_AUTH__PASSWORD) or as files
    events_bus_auth: NatsAuth = field(default_factory=NatsAuth)
    tokenizer: str = str(DEFAULT_TOKENIZER_DIR)
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> tokenizer dir/file
    tenant_header: str | None = None  # when set, its value is the cache_salt (trusted gateway header)
    tenant_missing: str = "reject"  # with tenant_header set, a request without it: reject (400) | no_salt
    # the key of the tenants' cache salts (HMAC-SHA256 of the tenant, router/frontends/openai.py tenant_salt), so
    # that no one can guess another tenant's salt: inline (KVROUTER_SALT_SECRET) or a file's first line; unset: a
    # random one at startup, shared by this router's --processes but not by its replicas (no cache reuse across);
    # neither shown nor compared (two loads of one file are equal configs, though their random secrets differ)
    salt_secret: str | None = field(default=None, repr=False, compare=False)
    salt_secret_file: str | None = None
    max_n: int = 128  # a request's n (choices per prompt) at most this: 400 past it
    max_model_len: int | None = None  # largest context a prompt may need; unset: the workers' own, learned
    session_header: str = "x-session-id"
    max_body_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    probe_interval_s: float = 1.0
    upstream_timeout_s: float = 600.0
    prefill_timeout_s: float = 30.0  # disaggregation: a prefill worker slower than this is given up on (fallback)
    decision_log_size: int = 100
    # shared in-flight load (router/load/exchange.py): replicas over NATS core subjects; the processes of one
    # router (processes > 1) over local Unix sockets unless load_bus is set
    load_bus: str | None = None  # nats://host:4222: every replica publishes its deltas, folds the others'
    replica_id: str | None = None  # this replica's name on the bus (default: host-pid)
    processes: int = 1  # serve/epp: this many processes on one port (SO_REUSEPORT), sharing their load


def _check(value: Any, tp: Any, where: str) -> Any:
    """Coerce/validate ``value`` against a dataclass field type; nested dataclasses from mappings."""
    origin = typing.get_origin(tp)
    if tp is SchedulingConfig:
        try:
            return parse_scheduling(value, where)
        except ProfileError as e:
            raise ConfigError(str(e)) from None
    if tp is FlowParams:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        try:
            return parse_flow_params(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
    if tp is SloConfig:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        try:
            return parse_slo_config(value)
        except ObjectiveError as e:
            raise ConfigError(str(e)) from None
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return {str(k): _check(v, typing.get_args(tp)[1], f"{where}.{k}") for k, v in value.items()}
    if origin is list and typing.get_args(tp)[0] is WorkerSpec:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of workers")
        try:
            return [_spec(e, f"{where}[{i}]") if isinstance(e, dict) else parse_worker_arg(str(e))
                    for i, e in enumerate(value)]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return value


def _build(cls: Any, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {k: _check(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


ENV_PREFIX = "KVROUTER_"
# Read by the project's own tools, not config keys.
_NOT_CONFIG = frozenset({"KVROUTER_VLLM_VENV", "KVROUTER_EVENT_LOOP"})  # the latter: router/frontends/event_loop.py
# What Kubernetes injects for a Service named kvrouter or kvrouter-*: KVROUTER_SERVICE_HOST, KVROUTER_PORT,
# KVROUTER_EPP_PORT_9002_TCP_ADDR, ... (never with a double underscore): ignored, not errors.
_SERVICE_LINK = re.compile(r"^KVROUTER(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT"
                           r"(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$")


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _key_type(var: str, path: list[str]) -> Any:
    """The declared type at a dotted path of RouterConfig; ``Any`` below a free-form mapping (scheduling,
    tokenizers); ConfigError naming ``var`` for a key that does not exist."""
    tp: Any = RouterConfig
    for depth, key in enumerate(path):
        tp = _unwrap(tp)
        where = ".".join(path[:depth]) or "the top level"
        if tp is SchedulingConfig or tp is SloConfig or tp is FlowParams or tp is Any:
            return Any  # checked as a whole by parse_scheduling / parse_slo_config / parse_flow_params
        if typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
            continue
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{var}: {where} is not a mapping; it takes no key {key!r}")
        hints = typing.get_type_hints(tp)
        if key not in hints or key not in {f.name for f in dataclasses.fields(tp)}:
            known = sorted(f.name for f in dataclasses.fields(tp))
            raise ConfigError(f"{var}: {where} has no key {key!r}; known: {known}")
        tp = hints[key]
    return tp


def _env_value(var: str, text: str, tp: Any) -> Any:
    """Parse one variable's text as YAML, then check it with the file's typed checks (errors name ``var``).
    For a key that is a string, a number or boolean YAML would read (``123``, ``yes``) stays the text."""
    is_str = _unwrap(tp) is str
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        if is_str:
            return text
        raise ConfigError(f"{var}: not a valid YAML value: {e}") from None
    if is_str and isinstance(value, bool | int | float):
        value = text.strip()
    if tp is not Any:
        _check(value, tp, var)
    return value


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, Any]]:
    """``KVROUTER_ROUTING__POLICY=round_robin`` -> ``{"routing.policy": ("KVROUTER_ROUTING__POLICY", ...)}``.

    The prefix and the key are case-insensitive; ``__`` separates levels; each value is YAML, checked against
    its key's type here, so a wrong one is an error naming the variable. Unknown keys are errors too (except
    Kubernetes service-link variables and ``KVROUTER_VLLM_VENV``, which are not config keys)."""
    environ = os.environ if environ is None else environ
    found: dict[str, tuple[str, Any]] = {}
    for var in sorted(environ, key=lambda v: (v.count("__"), v)):  # whole sections first, then their keys
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX) or upper in _NOT_CONFIG:
            continue
        name = upper[len(ENV_PREFIX):]
        path = [p.lower() for p in name.split("__")]
        if "__" not in name and _SERVICE_LINK.match(upper) and path[0] not in _TOP_LEVEL:
            continue
        if not all(path):
            raise ConfigError(f"{var}: empty key segment (use a double underscore between levels, "
                              f"e.g. KVROUTER_ROUTING__POLICY)")
        dotted = ".".join(path)
        if dotted in found:
            raise ConfigError(f"{var}: sets {dotted} like {found[dotted][0]}; give one of them")
        found[dotted] = (var, _env_value(var, environ[var], _key_type(var, path)))
    return found


def _merge(node: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``path`` in nested mappings; a mapping value merges into a mapping already there."""
    *parents, leaf = path
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for k, v in value.items():
            _merge(node[leaf], [str(k)], v)
    else:
        node[leaf] = value


def _has(node: Any, path: list[str]) -> bool:
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None, *,
                environ: Mapping[str, str] | None = None, defaults: dict[str, Any] | None = None) -> RouterConfig:
    """Read the YAML file (if any), then ``KVROUTER_...`` variables of ``environ`` (default: ``os.environ``),
    then dotted-key overrides such as ``{"routing.policy": "precise"}`` (None: not given). ``defaults`` are
    dotted keys used only where none of those sets the key."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
        if data.get("kind") == "EndpointPickerConfig":
            raise ConfigError(f"{path}: this is the upstream EPP's plugin configuration (EndpointPickerConfig); "
                              "kvrouter reads its own YAML (docs/configuration.md)")
    from_env = env_overrides(environ)
    for dotted, (_, value) in from_env.items():
        _merge(data, dotted.split("."), value)
    for dotted, value in (defaults or {}).items():
        if value is not None and not _has(data, dotted.split(".")):
            _merge(data, dotted.split("."), value)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        return _finish(data, str(path or "config"))
    except ConfigError as e:
        # a check across keys names the key; say which variable set it, when one did
        hint = [var for dotted, (var, value) in from_env.items()
                if dotted.rsplit(".", 1)[-1] in str(e) or (isinstance(value, str) and repr(value) in str(e))]
        if hint and not any(v in str(e) for v in hint):
            raise ConfigError(f"{e} (set by {', '.join(hint)})") from None
        raise


def _with_timing_file(routing: dict[str, Any], where: str) -> dict[str, Any]:
    """``routing.timing_file`` (``kvrouter calibrate --out``): its coefficients and token budget become the
    cost model's prior, under any ``routing.cost`` key given explicitly."""
    routing = dict(routing)
    path = routing.pop("timing_file")
    try:
        spec = read_timing_file(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}.routing.timing_file: {e}") from None
    prior: dict[str, Any] = dict(spec.coefficients)
    if spec.step_token_budget is not None:
        prior["step_token_budget"] = spec.step_token_budget
    cost = routing.get("cost")
    routing["cost"] = {**prior, **cost} if isinstance(cost, dict) else (cost if cost is not None else prior)
    return routing


def _finish(data: dict[str, Any], where: str) -> RouterConfig:
    scheduling = data.pop("scheduling", None)
    routing = data.get("routing")
    if isinstance(routing, dict) and routing.get("timing_file") is not None:
        routing = data["routing"] = _with_timing_file(routing, where)
    if scheduling is not None and (routing is None or isinstance(routing, dict)):
        # the profiles must be known before routing.policy names one
        data["routing"] = {**(routing or {}), "scheduling": _check(scheduling, SchedulingConfig,
                                                                   f"{where}.scheduling")}
    cfg = _build(RouterConfig, data, where)
    cfg.scheduling = cfg.routing.scheduling
    try:  # every plugin, parameter and import resolved now, not at the first request
        build_profile(cfg.routing.policy, cfg.scheduling, random.Random(0))
    except ProfileError as e:
        raise ConfigError(str(e)) from None
    if cfg.max_attempts < 1:
        raise ConfigError("max_attempts must be at least 1")
    if cfg.epp.grpc_server not in ("kvrouter", "grpcio"):
        raise ConfigError(f"epp.grpc_server: expected kvrouter or grpcio, got {cfg.epp.grpc_server!r}")
    for key, grace in (("http.grace_s", cfg.http.grace_s), ("epp.grace_s", cfg.epp.grace_s)):
        if not 0 <= grace < float("inf"):
            raise ConfigError(f"{key} must be a finite number of seconds, 0 or more, got {grace!r}")
    epp_ports = {"epp.port": cfg.epp.port, "epp.health_port": cfg.epp.health_port,
                 "epp.metrics_port": cfg.epp.metrics_port, "epp.admin_port": cfg.epp.admin_port}
    clash = [key for key, port in epp_ports.items() if port == cfg.epp.rank_port]
    if cfg.epp.rank_port is not None and clash:
        raise ConfigError(f"epp.rank_port {cfg.epp.rank_port} is also {clash[0]}: the Rank service gets a port of "
                          "its own, on admin.host")
    if cfg.tenant_missing not in ("reject", "no_salt"):
        raise ConfigError(f"tenant_missing: expected reject or no_salt, got {cfg.tenant_missing!r}")
    _resolve_salt_secret(cfg)
    if not 1 <= cfg.max_n <= 65536:  # so a request's work (max_tokens x n x 256 prompts) stays within 2^63
        raise ConfigError(f"max_n must be from 1 to 65536, got {cfg.max_n}")
    if cfg.events_bus is not None and cfg.events_bind is not None:
        raise ConfigError("events_bus and events_bind exclude each other: on the bus the relays read the engines")
    if cfg.events_bus is not None and not cfg.events_bus.startswith(("nats://", "tls://", "ws://", "wss://")):
        raise ConfigError(f"events_bus: expected a nats:// URL, got {cfg.events_bus!r}")
    if cfg.events_bus_auth.configured and cfg.events_bus is None:
        raise ConfigError("events_bus_auth is set but events_bus is not: the credentials would go unused")
    try:
        cfg.events_bus_auth.check()
    except ValueError as e:
        raise ConfigError(f"events_bus_auth: {e}") from None
    if cfg.max_model_len is not None and cfg.max_model_len < 1:
        raise ConfigError("max_model_len must be at least 1")
    if cfg.processes < 1:
        raise ConfigError("processes must be at least 1")
    if cfg.processes > 1 and cfg.events_bind:
        raise ConfigError("processes > 1 cannot share one events_bind socket: give each worker its events "
                          "endpoint (the router dials it) instead")
    if cfg.load_bus is not None and not cfg.load_bus.startswith(("nats://", "tls://")):
        raise ConfigError(f"load_bus: expected a nats:// (or tls://) URL, got {cfg.load_bus!r}")
    if cfg.replica_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", cfg.replica_id):
        raise ConfigError(f"replica_id: letters, digits, '-' and '_' only (one NATS subject token), got "
                          f"{cfg.replica_id!r}")
    return cfg


def _resolve_salt_secret(cfg: RouterConfig) -> None:
    """``salt_secret`` from itself, ``salt_secret_file``, or (neither) random: set once here, before
    ``--processes`` children get the config, so that every process of one router derives the same salts."""
    if cfg.salt_secret is not None and cfg.salt_secret_file is not None:
        raise ConfigError("salt_secret and salt_secret_file exclude each other: give one")
    if cfg.salt_secret_file is not None:
        try:
            lines = Path(cfg.salt_secret_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"salt_secret_file: cannot read {cfg.salt_secret_file}: {e}") from None
        cfg.salt_secret = lines[0].strip() if lines else ""
    if cfg.salt_secret is None:
        cfg.salt_secret = secrets.token_hex(32)
        if cfg.tenant_header:
            log.warning("salt_secret is not set: the tenants' cache salts are keyed by a random secret made at "
                        "startup; replicas need one shared salt_secret (or salt_secret_file, KVROUTER_SALT_SECRET) "
                        "to reuse each other's cached prefixes, and a restart starts the tenants' caches afresh")
    elif len(cfg.salt_secret) < 16:
        raise ConfigError("salt_secret must be at least 16 characters (a guessable secret makes the tenants' "
                          "salts guessable)")


_TOP_LEVEL = frozenset(f.name for f in dataclasses.fields(RouterConfig))


__all__ = ["Admin", "ConfigError", "CostParams", "Listen", "RouterConfig", "env_overrides", "load_config"]
