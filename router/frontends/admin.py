"""The fleet's admin endpoints, one implementation for the proxy and the picker (served on ``admin``: localhost
by default): ``GET /admin/workers`` (each worker's state), ``POST /admin/drain?worker=ID`` and
``POST /admin/undrain?worker=ID`` (a drained worker takes no new request; those it has finish).

The admin port has no authentication: being bound to loopback is its protection. A browser on the same host
is the one client that can still reach it on someone else's behalf, so ``admin_guard`` answers 403 to every
request a web page could make (docs/fleet.md, "Admin API"):

- a ``Host`` other than ``localhost``, an IP literal or the configured ``admin.host``: DNS rebinding (a page's
  own name re-resolved to 127.0.0.1, which makes the admin same-origin to the page) always carries the page's
  name, never an address;
- an ``Origin`` other than the admin's own (``http://`` + the Host it was reached at), or ``Sec-Fetch-Site:
  cross-site`` / ``same-site``: a request another page made (a form post, ``fetch`` in ``no-cors`` mode);
- a state-changing request (anything but GET/HEAD) that a page could send without a CORS preflight: it must
  carry ``Content-Type: application/json`` or an ``X-Kvrouter-Admin`` header, which no cross-origin page can
  set without the preflight this server never grants (a browser without Origin/Sec-Fetch headers, or a
  missed case above, is stopped here).
"""

from __future__ import annotations

import ipaddress
import time
import urllib.parse
from collections.abc import Awaitable, Callable

from aiohttp import web

from router.frontends.fleet import Fleet
from router.frontends.openai import error_response as admin_error
from router.index.digest import residency_digest
from router.scheduling import RoutingCore

ADMIN_HEADER = "x-kvrouter-admin"  # present (any value): the request was not made by a web page
SAFE_METHODS = frozenset({"GET", "HEAD"})
CROSS_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values of a request another origin made

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _hostname(authority: str) -> str | None:
    """The host of ``host[:port]`` / ``[v6]:port``, lower case without brackets; None if it does not parse."""
    try:
        parts = urllib.parse.urlsplit("//" + authority)
        _ = parts.port  # raises on a malformed port
    except ValueError:
        return None
    if parts.username is not None or parts.path or parts.query or parts.fragment:
        return None
    return parts.hostname


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def admin_guard(admin_host: str | None = None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The admin app's middleware: 403 for whatever a web page could have sent (the module's docstring).
    ``admin_host``: the configured ``admin.host``; a name there (not an address) is accepted as a Host too."""
    names = {"localhost"}
    if admin_host and not _is_ip(admin_host.strip("[]")):
        names.add(admin_host.lower().rstrip("."))

    def refused(why: str) -> web.Response:
        return admin_error(403, f"admin request refused: {why}", "ForbiddenError")

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        authority = request.headers.get("Host")
        if authority is not None:  # (HTTP/1.0 may omit it; every browser sends it)
            host = _hostname(authority)
            if host is None or not (_is_ip(host) or host.rstrip(".") in names):
                return refused(f"Host {authority[:100]!r} is not localhost, an IP address or admin.host "
                               "(DNS rebinding); reach the admin port by address")
        origin = request.headers.get("Origin")
        if origin is not None:
            own = {f"http://{authority}".lower(), f"https://{authority}".lower()} if authority else set()
            if origin.lower() not in own:
                return refused(f"Origin {origin[:100]!r} is not the admin's own: a cross-origin request (a web "
                               "page) may not use the admin API")
        site = request.headers.get("Sec-Fetch-Site", "").lower()
        if site in CROSS_SITE:
            return refused(f"Sec-Fetch-Site: {site}: a request another web page made may not use the admin API")
        if request.method not in SAFE_METHODS and ADMIN_HEADER not in request.headers \
                and request.content_type != "application/json":
            return refused(f"{request.method} {request.path} changes the fleet: send it with "
                           f"'Content-Type: application/json' or an '{ADMIN_HEADER}: 1' header (a web page "
                           "cannot send either cross-origin)")
        return await handler(request)

    return guard


class FleetAdmin:
    def __init__(self, core: RoutingCore, fleet: Fleet) -> None:
        self.core, self.fleet = core, fleet

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/admin/workers", self.workers_state), web.post("/admin/drain", self.drain),
                web.post("/admin/undrain", self.drain)]

    async def workers_state(self, request: web.Request) -> web.Response:
        """Each worker's state; ``?digest=1`` adds its residency fingerprint (replicas compare them; O(blocks))."""
        now = time.monotonic()
        diagnoses = self.fleet.diagnose()
        digest = request.query.get("digest") == "1"
        out = {}
        for wid, ep in self.core.endpoints.items():
            st = self.core.feeder.status(wid, now)
            load = self.core.load.workers.get(wid)
            found = diagnoses.get(wid)
            out[wid] = {"url": ep.url, "address": ep.address, "healthy": ep.healthy, "draining": ep.draining,
                        "index_state": self.core.index_state(wid, now), "last_event_age_s": st.last_event_age_s,
                        "last_seq": st.last_seq, "blocks": {m.name: n for m, n in st.blocks.items()},
                        "inflight": load.requests if load else 0,
                        "problem": found.problem if found else None, "cause": found.cause if found else None,
                        # its adapters named like another worker's base model: not routed there (docs/fleet.md)
                        "refused_loras": sorted(self.fleet.name_conflicts.get(wid, ()))}
            if digest:
                out[wid]["index_digest"] = residency_digest(self.core.index, wid)
        shared = self.core.state.shared_load
        if shared is None:
            return web.json_response({"workers": out})
        return web.json_response({"workers": out, "shared_load": shared.describe(now)})

    async def drain(self, request: web.Request) -> web.Response:
        wid = request.query.get("worker")
        if not wid:
            return admin_error(400, "?worker=ID is required")
        draining = request.path.endswith("/drain")
        if not self.fleet.drain(wid, draining=draining):
            return admin_error(404, f"unknown worker {wid!r}", "NotFoundError")
        if self.core.state.shared_load is not None:  # the other processes and replicas drain it too
            self.core.state.shared_load.local_drained(wid, draining)
        return web.json_response({"worker": wid, "draining": self.core.endpoints[wid].draining})
