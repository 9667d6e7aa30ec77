"""The fleet's admin endpoints, one implementation for the proxy and the picker (served on ``admin``: localhost
by default): ``GET /admin/workers`` (each worker's state), ``POST /admin/drain?worker=ID`` and
``POST /admin/undrain?worker=ID`` (a drained worker takes no new request; those it has finish)."""

from __future__ import annotations

import time

from aiohttp import web

from router.frontends.fleet import Fleet
from router.frontends.openai import error_response as admin_error
from router.index.digest import residency_digest
from router.scheduling import RoutingCore


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
                        "problem": found.problem if found else None, "cause": found.cause if found else None}
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
