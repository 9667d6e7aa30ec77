"""The admin port against a web page (issue 50, finding 12): the admin API has no authentication, being bound to
loopback, so a page open in a browser on the router's host is the client to fear. Every request such a page
can make is refused 403 and changes nothing: a cross-origin simple POST (``Origin: evil``, ``text/plain``, a
form), a request through DNS rebinding (a page's own name re-resolved to 127.0.0.1: same-origin, the Host its
name), ``Sec-Fetch-Site: cross-site``; a POST with no browser headers at all but a simple content type too. What
kvrouter's own callers send (``Content-Type: application/json`` or ``X-Kvrouter-Admin``, Host an address or
localhost) still works. Through the proxy's admin app and the picker's (``kvrouter epp --admin-port``), over
real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from bench.load import free_port
from router.config import load_config
from router.discovery import parse_worker_arg
from router.frontends.epp import run_epp
from tests.test_proxy import proxy

pytestmark = pytest.mark.sockets
DEAD = "http://127.0.0.1:9"  # a worker nobody answers for: drains act on the fleet's record alone

# (what a web page could send, the words the 403 names); every one is a POST /admin/drain?worker=w0
FORGED: list[tuple[str, dict[str, str], bytes, str]] = [
    ("a cross-origin form post", {"Origin": "http://evil.example", "Content-Type": "text/plain"}, b"x", "Origin"),
    ("a cross-origin post with a JSON body", {"Origin": "http://evil.example", "Content-Type": "application/json"},
     b"{}", "Origin"),
    ("a sandboxed page's null origin", {"Origin": "null", "Content-Type": "application/json"}, b"{}", "Origin"),
    ("another port of localhost", {"Origin": "http://localhost:3000", "Content-Type": "text/plain"}, b"x",
     "Origin"),
    ("DNS rebinding", {"Host": "evil.example:8001", "Origin": "http://evil.example:8001",
                       "Content-Type": "application/json"}, b"{}", "Host"),
    ("DNS rebinding without Origin", {"Host": "evil.example", "Content-Type": "application/json"}, b"{}", "Host"),
    ("a malformed Host", {"Host": "127.0.0.1:notaport", "Content-Type": "application/json"}, b"{}", "Host"),
    ("a no-cors fetch", {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}, b"x", "Sec-Fetch-Site"),
    ("a same-site page", {"Sec-Fetch-Site": "same-site", "Content-Type": "application/json"}, b"{}",
     "Sec-Fetch-Site"),
    ("a simple post without browser headers", {"Content-Type": "text/plain"}, b"x", "Content-Type"),
    ("a form-encoded post", {"Content-Type": "application/x-www-form-urlencoded"}, b"a=b", "Content-Type"),
    ("an empty post", {}, b"", "Content-Type"),
]


async def draining(s: aiohttp.ClientSession, admin: str) -> dict[str, bool]:
    """Each worker's drained flag, as ``/admin/workers`` reports it to a plain GET (as curl sends it)."""
    async with s.get(admin + "/admin/workers") as r:
        assert r.status == 200, await r.text()
        return {w: st["draining"] for w, st in (await r.json())["workers"].items()}


async def attack(admin: str) -> None:
    """Every forged request is a 403 naming why, and no worker is ever drained; reads from a rebound page are
    refused too; then kvrouter's own ways of asking drain and undrain work."""
    port = admin.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as s:
        for what, headers, body, named in FORGED:
            async with s.post(admin + "/admin/drain", params={"worker": "w0"}, data=body, headers=headers) as r:
                out = await r.json()
                assert r.status == 403, (what, r.status, out)
            assert out["code"] == 403 and named in out["message"], (what, out)
            assert await draining(s, admin) == {"w0": False, "w1": False}, what
        for headers in ({"Host": "evil.example"}, {"Origin": "http://evil.example"}):  # a rebound page reading
            async with s.get(admin + "/admin/workers", headers=headers) as r:
                assert r.status == 403, headers
        # what is not a web page's: an address or localhost as Host, its own origin, JSON or the admin header
        allowed: list[tuple[str, dict[str, str], bytes]] = [
            ("drain", {"Content-Type": "application/json"}, b"{}"),
            ("undrain", {"X-Kvrouter-Admin": "1"}, b""),
            ("drain", {"Host": f"localhost:{port}", "Content-Type": "application/json; charset=utf-8"}, b"{}"),
            ("undrain", {"Origin": f"http://127.0.0.1:{port}", "Content-Type": "application/json"}, b"{}"),
            ("drain", {"Host": f"[::1]:{port}", "Sec-Fetch-Site": "same-origin", "X-Kvrouter-Admin": "yes"}, b""),
        ]
        for action, headers, body in allowed:
            async with s.post(admin + f"/admin/{action}", params={"worker": "w0"}, data=body,
                              headers=headers) as r:
                assert r.status == 200, (action, headers, await r.text())
                assert await r.json() == {"worker": "w0", "draining": action == "drain"}
            assert await draining(s, admin) == {"w0": action == "drain", "w1": False}
        async with s.get(admin + "/admin/workers", headers={"Host": "localhost"}) as r:
            assert r.status == 200 and (await r.json())["workers"]["w0"]["draining"] is True


async def test_the_proxys_admin_refuses_what_a_web_page_can_send():
    async with proxy([f"{DEAD},id=w0", f"{DEAD},id=w1"]) as (server, _url, admin):
        await attack(admin)
        assert server.core.endpoints["w0"].draining and not server.core.endpoints["w1"].draining
        async with aiohttp.ClientSession() as s:  # its other pages are behind the same guard
            for path in ("/debug/decision", "/metrics"):
                async with s.get(admin + path, headers={"Host": "evil.example"}) as r:
                    assert r.status == 403, path
                async with s.get(admin + path) as r:
                    assert r.status == 200, path


@contextlib.asynccontextmanager
async def picker_with_admin() -> AsyncIterator[str]:
    """``run_epp`` in this process with ``epp.admin_port``: the admin app it builds itself."""
    admin_port = free_port()
    cfg = load_config(None, {"routing.block_size": 16, "probe_interval_s": 0.2, "epp.host": "127.0.0.1",
                             "epp.port": free_port(), "epp.health_port": free_port(),
                             "epp.metrics_host": "127.0.0.1", "epp.metrics_port": free_port(),
                             "epp.admin_port": admin_port, "admin.host": "127.0.0.1"})
    cfg.workers = [parse_worker_arg(f"{DEAD},id=w0"), parse_worker_arg(f"{DEAD},id=w1")]
    started = asyncio.Event()
    task = asyncio.create_task(run_epp(cfg, started=started))
    try:
        await asyncio.wait_for(started.wait(), 20)
        yield f"http://127.0.0.1:{admin_port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_pickers_admin_refuses_what_a_web_page_can_send():
    async with picker_with_admin() as admin:
        await attack(admin)
