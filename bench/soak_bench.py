"""``kvrouter bench soak``: the real proxy under steady mixed load, bad input and worker faults, for minutes.

``kvrouter serve`` runs in its own process (``--tenant-header x-tenant``) in front of three simulated workers,
each in its own process at time-scale 1 (streams take real time), all on loopback. This process is the only
client, and every loop in it is bounded in count and time:

- good traffic: streamed and non-streamed completions and chat completions on a few shared prefixes of a few
  hundred tokens, ``concurrency`` at a time, with the tenant header;
- bad input, one at a time, round robin: malformed JSON, wrong types, token ids >= 2**32 and bools, a string
  ``stream``, 100k-deep JSON, a lone surrogate, a missing tenant header, a non-API path, forged
  ``x-gateway-destination-endpoint`` headers (served, the header ignored), and a ~30 MB prompt every
  ``big_interval_s`` (the workers report max_model_len 32768: it must be a quick 400);
- faults: every ``kill_interval_s`` the worker with most streams in flight is killed with SIGKILL and
  restarted on the same ports; once, another worker is stopped (SIGSTOP) for ``stop_s`` then continued.

Recorded: requests by (kind, status); how each good stream ended (``[DONE]``, an SSE error event then a cut,
a cut, or a clean end without ``[DONE]``: never allowed); 5xx to bad input (never allowed) and to good
traffic (only around faults); /health latency every 0.5 s; the proxy's RSS every 10 s; its /metrics.
Verdict FAIL on any bad-input 5xx or other unexpected answer to bad input, any good stream that ended clean
without ``[DONE]``, RSS growth from warm-up to the end over 200 MB, or the proxy dying.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.load import free_port, port_open, running

TENANT_HEADER = "x-tenant"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
WORKER_MAX_MODEL_LEN = 32768
RSS_GROWTH_LIMIT_MB = 200.0
GOOD_KINDS = ("completion", "completion_stream", "chat", "chat_stream")
STREAM_ENDINGS = ("done", "error_event", "cut", "clean_no_done", "error_event_clean_end")
FAULT_WINDOW_S = 5.0  # a good request overlapping [fault, recovered + this] is "around a fault"
BIG_PROMPT = json.dumps({"model": "sim-model", "prompt": "word " * 6_000_000, "max_tokens": 4}).encode()  # 30 MB
_TOPICS = ("billing", "geology", "contracts", "compilers", "astronomy", "gardening", "networks", "history")
PREFIXES = tuple(f"you are a helpful assistant for {t}; the shared system document about {t} says that every "
                 f"answer is found in the question and must be short, precise and polite. " * 8 for t in _TOPICS)


def _good_body(kind: str, rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    prefix = PREFIXES[rng.randrange(len(PREFIXES))]
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": rng.randint(16, 200)}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": f"question {i}"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prefix + f" question {i}"
        path = "/v1/completions"
    if kind.endswith("stream"):
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return path, body


def _bad_cases() -> dict[str, Callable[[int], tuple[str, bytes, dict[str, str], int]]]:
    """kind -> (i -> path, raw body, headers, expected status). Everything but one case carries the tenant
    header, so the body itself is what gets checked."""
    tenant = {TENANT_HEADER: "tenant-a", "content-type": "application/json"}

    def js(path: str, body: Any, status: int = 400, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        raw = json.dumps(body).encode()
        return lambda i: (path, raw, headers if headers is not None else tenant, status)

    def raw(path: str, data: bytes, status: int = 400):  # type: ignore[no-untyped-def]
        return lambda i: (path, data, tenant, status)

    good = {"model": "sim-model", "prompt": PREFIXES[0] + " forged", "max_tokens": 2}
    forged_to = ("127.0.0.1:1", "10.255.255.1:80", "[::1]:9")

    def forged(i: int) -> tuple[str, bytes, dict[str, str], int]:
        h = {**tenant, "x-gateway-destination-endpoint": forged_to[i % len(forged_to)],
             "x-gateway-destination-endpoint-subset": forged_to[(i + 1) % len(forged_to)]}
        return "/v1/completions", json.dumps(good).encode(), h, 200  # served by a real worker, header ignored

    return {
        "malformed_json": raw("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b" " * 10),
        "not_an_object": raw("/v1/completions", b"[1, 2, 3]"),
        "prompt_int": js("/v1/completions", {"prompt": 5}),
        "text_part_int": js("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        "token_id_2_32": js("/v1/completions", {"prompt": [1, 2, 2**32]}),
        "token_id_2_70": js("/v1/completions", {"prompt": [1, 2, 2**70]}),
        "bool_token_ids": js("/v1/completions", {"prompt": [True, False]}),
        "stream_string": js("/v1/completions", {"prompt": [1, 2, 3], "stream": "false"}),
        "max_tokens_bool": js("/v1/completions", {"prompt": "hi", "max_tokens": True}),
        "deep_json": raw("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "lone_surrogate": raw("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}'),
        "missing_tenant": js("/v1/completions", good, 400, {"content-type": "application/json"}),
        "non_api_path": raw("/reset_prefix_cache", b"{}", 404),
        "non_api_fault": raw("/fault", b'{"kind": "crash"}', 404),
        "forged_destination": forged,
    }


BAD_KINDS = (*_bad_cases(), "big_prompt")


class SimProc:
    """One ``kvrouter worker sim`` process on fixed ports, so it can be killed and restarted on the same ones."""

    def __init__(self, wid: str, time_scale: float, log: Any) -> None:
        self.wid = wid
        self.port, self.ev, self.rp = free_port(), free_port(), free_port()
        self.time_scale = time_scale
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def spec(self) -> str:
        return f"http://127.0.0.1:{self.port},id={self.wid},events=tcp://127.0.0.1:{self.ev}," \
               f"replay=tcp://127.0.0.1:{self.rp}"

    def spawn(self) -> None:
        cmd = [sys.executable, "-m", "router.cli", "worker", "sim", "--port", str(self.port),
               "--events-endpoint", f"tcp://[::ffff:127.0.0.1]:{self.ev}",  # '::' binds, loopback only
               "--replay-endpoint", f"tcp://[::ffff:127.0.0.1]:{self.rp}",
               "--time-scale", str(self.time_scale), "--max-model-len", str(WORKER_MAX_MODEL_LEN)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self.starts += 1

    async def start(self, timeout: float = 30.0) -> None:
        """Spawn and wait until the HTTP port accepts; respawn if it exits (its ports may still be held)."""
        deadline = time.monotonic() + timeout
        self.spawn()
        ready = port_open(self.port)
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.wid} did not restart on port {self.port}")
                await asyncio.sleep(0.3)
                self.spawn()
            elif await asyncio.to_thread(ready):
                return
            elif time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.wid} did not become ready on port {self.port}")
            await asyncio.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        await asyncio.to_thread(self.proc.wait)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def _metric_values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


@dataclass
class Soak:
    url: str
    workers: list[SimProc]
    proxy_pid: int
    duration_s: float
    kill_interval_s: float
    big_interval_s: float
    stop_at_s: float | None
    stop_s: float
    concurrency: int
    bad_interval_s: float
    health_interval_s: float
    rss_interval_s: float
    max_requests: int
    seed: int
    t0: float = 0.0
    done: bool = False
    sent: int = 0
    requests: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (category, kind, status)
    endings: Counter[tuple[str, str]] = field(default_factory=Counter)  # (stream kind, ending)
    good_log: list[tuple[float, float, str, str, str | None]] = field(default_factory=list)  # t0, t1, kind,
    # status or ending, worker
    bad_samples: list[dict[str, Any]] = field(default_factory=list)
    big: list[dict[str, Any]] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    health_status: Counter[str] = field(default_factory=Counter)
    rss: list[tuple[float, float]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)
    active: dict[int, list[Any]] = field(default_factory=dict)  # stream id -> [worker, chunks]
    doomed: dict[int, int] = field(default_factory=dict)  # stream id -> kill index
    _ids: int = 0

    def el(self) -> float:
        return time.monotonic() - self.t0

    def more(self) -> bool:
        return not self.done and self.sent < self.max_requests

    # ---- good traffic ------------------------------------------------------------------------------------
    async def good(self, session: aiohttp.ClientSession, kind: str, i: int, rng: random.Random,
                   record: bool = True) -> str:
        path, body = _good_body(kind, rng, i)
        headers = {TENANT_HEADER: TENANTS[i % len(TENANTS)]}
        self._ids += 1
        sid = self._ids
        t0 = self.el()
        worker = None
        status = "?"
        ending = None
        try:
            async with session.post(self.url + path, json=body, headers=headers) as r:
                worker = r.headers.get("x-kvrouter-worker")
                status = str(r.status)
                if r.status == 200 and body.get("stream"):
                    self.active[sid] = [worker, 0]
                    ending = await self._read_stream(r, sid)
                else:
                    try:
                        data = await r.read()
                        if r.status == 200:
                            parsed = json.loads(data)
                            ending = "ok" if parsed.get("choices") else "bad_body"
                    except aiohttp.ClientPayloadError:
                        ending = "cut"
                    except ValueError:
                        ending = "bad_body"
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            status = f"exc:{type(e).__name__}"
        except TimeoutError:
            status = "exc:timeout"
        finally:
            self.active.pop(sid, None)
        if ending is not None and kind.endswith("stream"):
            if record:
                self.endings[(kind, ending)] += 1
            kill = self.doomed.pop(sid, None)
            if kill is not None:
                self.kills[kill]["stream_endings"][ending] += 1
        if record:
            self.requests[("good", kind, f"{status}:{ending}" if ending in ("cut", "bad_body") else status)] += 1
            self.good_log.append((t0, self.el(), kind, ending or status, worker))
        return ending or status

    async def _read_stream(self, r: aiohttp.ClientResponse, sid: int) -> str:
        saw_done = saw_error = False
        try:
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    saw_done = True
                    continue
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict) and "error" in event:
                    saw_error = True
                else:
                    self.active[sid][1] += 1
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return "error_event" if saw_error else "cut"
        if saw_error:
            return "error_event_clean_end"
        return "done" if saw_done else "clean_no_done"

    async def good_client(self, n: int) -> None:
        rng = random.Random(self.seed * 1000 + n)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            i = n
            while self.more():
                self.sent += 1
                await self.good(session, rng.choice(GOOD_KINDS), i, rng)
                i += self.concurrency

    # ---- bad input -------------------------------------------------------------------------------------
    async def bad(self, session: aiohttp.ClientSession, kind: str, case: Any, i: int, record: bool = True) -> str:
        path, data, headers, expected = case(i)
        t0 = self.el()
        message = ""
        try:
            async with session.post(self.url + path, data=data, headers=headers) as r:
                status = str(r.status)
                body = await r.read()
                message = body[:200].decode(errors="replace")
                if kind == "forged_destination" and r.headers.get("x-kvrouter-worker") not in \
                        {w.wid for w in self.workers}:
                    status = f"{status}:not-a-worker"
        except (aiohttp.ClientError, TimeoutError) as e:
            status = f"exc:{type(e).__name__}"
        if record:
            self.requests[("bad", kind, status)] += 1
            if status != str(expected) and len(self.bad_samples) < 20:
                self.bad_samples.append({"kind": kind, "t": round(t0, 2), "status": status,
                                         "expected": expected, "message": message})
        return status

    async def bad_client(self) -> None:
        cases = list(_bad_cases().items())
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            i = 0
            while self.more():
                kind, case = cases[i % len(cases)]
                self.sent += 1
                await self.bad(session, kind, case, i)
                i += 1
                await asyncio.sleep(self.bad_interval_s)

    async def big_prompt(self, session: aiohttp.ClientSession, record: bool = True) -> None:
        t0 = self.el()
        headers = {TENANT_HEADER: "tenant-a", "content-type": "application/json"}
        message = ""
        try:
            async with session.post(self.url + "/v1/completions", data=BIG_PROMPT, headers=headers) as r:
                status = str(r.status)
                message = (await r.read())[:200].decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as e:
            status = f"exc:{type(e).__name__}"
        ms = (self.el() - t0) * 1e3
        if record:
            self.requests[("bad", "big_prompt", status)] += 1
            self.big.append({"t": round(t0, 2), "status": status, "ms": round(ms, 1),
                             "around_fault": self._around_fault(t0, t0 + ms / 1e3), "message": message[:120]})

    async def big_client(self) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            next_at = self.big_interval_s
            while self.more():
                if self.el() >= next_at:
                    self.sent += 1
                    await self.big_prompt(session)
                    next_at += self.big_interval_s
                await asyncio.sleep(0.1)

    # ---- samplers ----------------------------------------------------------------------------------------
    async def health_sampler(self) -> None:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self.done:
                t0 = time.monotonic()
                try:
                    async with session.get(self.url + "/health") as r:
                        await r.read()
                        self.health_status[str(r.status)] += 1
                except (aiohttp.ClientError, TimeoutError) as e:
                    self.health_status[f"exc:{type(e).__name__}"] += 1
                dt = time.monotonic() - t0
                self.health_ms.append(dt * 1e3)
                await asyncio.sleep(max(0.0, self.health_interval_s - dt))

    async def rss_sampler(self) -> None:
        while not self.done:
            await asyncio.sleep(self.rss_interval_s)
            with contextlib.suppress(OSError, RuntimeError):
                self.rss.append((round(self.el(), 1), rss_mb(self.proxy_pid)))

    # ---- faults ------------------------------------------------------------------------------------------
    def _streaming_on(self, wid: str) -> list[int]:
        return [sid for sid, (w, chunks) in self.active.items() if w == wid and chunks > 0]

    async def kill_one(self) -> None:
        victim = None
        deadline = time.monotonic() + 5.0  # wait (a little) for a worker that is mid-stream
        while time.monotonic() < deadline and not self.done:
            counts = {w.wid: len(self._streaming_on(w.wid)) for w in self.workers}
            best = max(counts, key=lambda k: counts[k])
            if counts[best]:
                victim = next(w for w in self.workers if w.wid == best)
                break
            await asyncio.sleep(0.02)
        if victim is None:
            victim = self.workers[len(self.kills) % len(self.workers)]
        streams = self._streaming_on(victim.wid)
        record: dict[str, Any] = {"t": round(self.el(), 2), "worker": victim.wid, "streams_in_flight": len(streams),
                                  "stream_endings": Counter()}
        for sid in streams:
            self.doomed[sid] = len(self.kills)
        self.kills.append(record)
        await victim.kill()
        try:
            await victim.start()
            record["restarted_at"] = round(self.el(), 2)
        except RuntimeError as e:
            record["restart_error"] = str(e)
        record["restart_s"] = round(self.el() - record["t"], 2)

    async def stop_one(self) -> None:
        last_killed = self.kills[-1]["worker"] if self.kills else None
        victim = next(w for w in self.workers if w.wid != last_killed)
        record: dict[str, Any] = {"t": round(self.el(), 2), "worker": victim.wid,
                                  "streams_in_flight": len(self._streaming_on(victim.wid))}
        self.stops.append(record)
        victim.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.stop_s)
        finally:
            victim.signal(signal.SIGCONT)
        record["continued_at"] = round(self.el(), 2)

    async def faults(self) -> None:
        next_kill = self.kill_interval_s
        stopped = self.stop_at_s is None
        while not self.done:
            now = self.el()
            if not stopped and now >= self.stop_at_s:  # type: ignore[operator]
                stopped = True
                await self.stop_one()
            elif next_kill <= self.duration_s - FAULT_WINDOW_S and now >= next_kill:
                next_kill += self.kill_interval_s
                await self.kill_one()
            await asyncio.sleep(0.05)

    def _fault_windows(self) -> list[tuple[float, float]]:
        inf = float("inf")  # a fault still in progress
        out = [(k["t"], k.get("restarted_at", k["t"] + k["restart_s"] if "restart_s" in k else inf) + FAULT_WINDOW_S)
               for k in self.kills]
        out += [(s["t"], s.get("continued_at", inf) + FAULT_WINDOW_S) for s in self.stops]
        return out

    def _around_fault(self, t0: float, t1: float) -> bool:
        return any(t0 <= b and t1 >= a for a, b in self._fault_windows())

    # ---- the run -----------------------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """Until the proxy knows the workers' context length; then one of everything, so the RSS baseline
        includes what the first big body and the first of each kind cost once."""
        timeout = aiohttp.ClientTimeout(total=60)
        probe = json.dumps({"model": "sim-model", "prompt": "word " * 40_000}).encode()
        headers = {TENANT_HEADER: "tenant-a", "content-type": "application/json"}
        async with aiohttp.ClientSession(timeout=timeout) as session:
            deadline = time.monotonic() + 30
            while True:  # a 400 the proxy gave itself (no worker header): the 32768 budget is learned
                async with session.post(self.url + "/v1/completions", data=probe, headers=headers) as r:
                    await r.read()
                    if r.status == 400 and "x-kvrouter-worker" not in r.headers:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy did not learn the workers' max_model_len")
                await asyncio.sleep(0.2)
            rng = random.Random(self.seed)
            kinds = GOOD_KINDS * 2
            results = await asyncio.gather(*(self.good(session, k, -1 - i, rng, record=False)
                                             for i, k in enumerate(kinds)))
            for kind, result in zip(kinds, results, strict=True):
                if result not in ("ok", "done"):
                    raise RuntimeError(f"warm-up {kind} request failed: {result}")
            for i, (kind, case) in enumerate(_bad_cases().items()):
                await self.bad(session, kind, case, i, record=False)
            await self.big_prompt(session, record=False)

    async def run(self) -> None:
        await self.warm_up()
        self.t0 = time.monotonic()
        self.rss.append((0.0, rss_mb(self.proxy_pid)))
        samplers = [asyncio.create_task(self.health_sampler()), asyncio.create_task(self.rss_sampler())]
        load = [asyncio.create_task(self.good_client(n)) for n in range(self.concurrency)]
        load += [asyncio.create_task(self.bad_client()), asyncio.create_task(self.big_client()),
                 asyncio.create_task(self.faults())]
        try:
            while self.el() < self.duration_s and self.sent < self.max_requests:
                if any(t.done() and t.exception() for t in load):
                    break
                await asyncio.sleep(0.1)
        finally:
            self.done = True
            finished, pending = await asyncio.wait(load + samplers, timeout=150)
            for t in pending:
                t.cancel()
            for t in finished:
                if not t.cancelled() and t.exception():
                    raise t.exception()  # type: ignore[misc]
        self.rss.append((round(self.el(), 1), rss_mb(self.proxy_pid)))

    # ---- the report --------------------------------------------------------------------------------------
    def report(self, metrics_text: str, proxy_alive: bool, proxy_log: str) -> dict[str, Any]:
        by: dict[str, dict[str, dict[str, int]]] = {"good": defaultdict(dict), "bad": defaultdict(dict)}
        for (cat, kind, status), n in sorted(self.requests.items()):
            by[cat][kind][status] = n
        streams = {k: {e: self.endings[(k, e)] for e in STREAM_ENDINGS} for k in GOOD_KINDS if "stream" in k}
        expected = {kind: case(0)[3] for kind, case in _bad_cases().items()}
        expected["big_prompt"] = 400
        bad_5xx = sum(n for (cat, _k, s), n in self.requests.items() if cat == "bad" and s[:1] == "5")
        bad_unexpected = {f"{k} {s}": n for (cat, k, s), n in self.requests.items()
                          if cat == "bad" and s != str(expected[k])}
        good_5xx = [(t0, t1) for t0, t1, _k, res, _w in self.good_log if res[:1] == "5"]
        good_err_streams = [(t0, t1) for t0, t1, _k, res, _w in self.good_log
                            if res in ("error_event", "cut", "error_event_clean_end")]
        good_failed = [(t0, t1, res) for t0, t1, _k, res, _w in self.good_log if res not in ("ok", "done")]
        for k in self.kills:
            after = k.get("restarted_at", float("inf"))
            k["good_ok_after"] = sum(1 for t0, _t, _k, res, _w in self.good_log if t0 > after and res in ("ok", "done"))
            k["good_ok_on_it_after"] = sum(1 for t0, _t, _k, res, w in self.good_log
                                           if t0 > after and res in ("ok", "done") and w == k["worker"])
            k["stream_endings"] = dict(k["stream_endings"])
        rss_values = [mb for _t, mb in self.rss]
        values = _metric_values(metrics_text)
        proxy_requests = {k.split('"')[1]: int(v) for k, v in values.items()
                          if k.startswith("kvrouter_requests_total{")}
        log_lines = proxy_log.splitlines()
        out: dict[str, Any] = {
            "config": {"duration_s": self.duration_s, "workers": len(self.workers), "concurrency": self.concurrency,
                       "kill_interval_s": self.kill_interval_s, "big_interval_s": self.big_interval_s,
                       "stop_at_s": self.stop_at_s, "stop_s": self.stop_s, "bad_interval_s": self.bad_interval_s,
                       "time_scale": self.workers[0].time_scale, "seed": self.seed},
            "elapsed_s": round(self.el(), 1),
            "requests": {"good": dict(by["good"]), "bad": dict(by["bad"]),
                         "total": sum(self.requests.values())},
            "streams": streams,
            "bad_input": {"expected_status": expected, "5xx": bad_5xx, "unexpected": bad_unexpected,
                          "unexpected_samples": self.bad_samples},
            "good": {
                "total": len(self.good_log),
                "ok": len(self.good_log) - len(good_failed),
                "http_5xx": len(good_5xx),
                "http_5xx_away_from_faults": sum(1 for a, b in good_5xx if not self._around_fault(a, b)),
                "streams_ended_in_error": len(good_err_streams),
                "streams_ended_in_error_away_from_faults": sum(1 for a, b in good_err_streams
                                                               if not self._around_fault(a, b)),
                "failed_away_from_faults": Counter(res for a, b, res in good_failed if not self._around_fault(a, b)),
            },
            "big_prompt": {"sent": len(self.big), "ms_p50": _pct([b["ms"] for b in self.big], 0.5),
                           "ms_max": max((b["ms"] for b in self.big), default=None), "each": self.big},
            "health": {"samples": len(self.health_ms), "status": dict(self.health_status),
                       "p50_ms": _pct(self.health_ms, 0.5), "p99_ms": _pct(self.health_ms, 0.99),
                       "max_ms": round(max(self.health_ms), 2) if self.health_ms else None},
            "rss_mb": {"start": round(rss_values[0], 1), "end": round(rss_values[-1], 1),
                       "max": round(max(rss_values), 1), "growth": round(rss_values[-1] - rss_values[0], 1),
                       "samples": [[t, round(mb, 1)] for t, mb in self.rss]},
            "proxy_metrics": {
                "kvrouter_responses_truncated_total": values.get("kvrouter_responses_truncated_total"),
                "kvrouter_retries_total": values.get("kvrouter_retries_total"),
                "kvrouter_requests_total": proxy_requests,
                "kvrouter_kv_event_gaps_total": sum(v for k, v in values.items()
                                                    if k.startswith("kvrouter_kv_event_gaps_total")),
            },
            "faults": {"kills": self.kills, "stops": self.stops},
            "proxy": {"alive_at_end": proxy_alive, "log_lines": len(log_lines),
                      "log_tracebacks": sum("Traceback" in line for line in log_lines),
                      "log_errors": sum(" ERROR " in line or " CRITICAL " in line for line in log_lines),
                      "log_warnings": sum(" WARNING " in line for line in log_lines),
                      "log_non_warnings_first": [line for line in log_lines if " WARNING " not in line][:40]},
        }
        out["good"]["failed_away_from_faults"] = dict(out["good"]["failed_away_from_faults"])
        failures = []
        if bad_5xx:
            failures.append(f"{bad_5xx} bad-input requests answered 5xx")
        if bad_unexpected:
            failures.append(f"bad input answered other than expected: {bad_unexpected}")
        no_done = sum(s["clean_no_done"] for s in streams.values())
        if no_done:
            failures.append(f"{no_done} good streams ended clean without [DONE]")
        if out["rss_mb"]["growth"] > RSS_GROWTH_LIMIT_MB:
            failures.append(f"proxy RSS grew {out['rss_mb']['growth']} MB (limit {RSS_GROWTH_LIMIT_MB})")
        if not proxy_alive:
            failures.append("the proxy process died")
        if any("restart_error" in k for k in self.kills):
            failures.append("a killed worker could not be restarted")
        warnings = []
        if out["good"]["http_5xx_away_from_faults"]:
            warnings.append(f"{out['good']['http_5xx_away_from_faults']} good requests got 5xx away from faults")
        if out["good"]["streams_ended_in_error_away_from_faults"]:
            warnings.append(f"{out['good']['streams_ended_in_error_away_from_faults']} good streams ended in "
                            "error away from faults")
        if out["good"]["failed_away_from_faults"]:
            warnings.append(f"good requests failed away from faults: {out['good']['failed_away_from_faults']}")
        slow_big = [b for b in self.big if b["ms"] > 2000]
        if slow_big:
            warnings.append(f"{len(slow_big)} of {len(self.big)} big prompts took over 2 s to refuse")
        if out["proxy"]["log_tracebacks"] or out["proxy"]["log_errors"]:
            warnings.append(f"proxy log: {out['proxy']['log_tracebacks']} tracebacks, "
                            f"{out['proxy']['log_errors']} errors")
        out["failures"] = failures
        out["warnings"] = warnings
        out["verdict"] = "FAIL" if failures else "PASS"
        return out


def default_intervals(duration_s: float) -> tuple[float, float, float]:
    """(kill interval, big-prompt interval, when to SIGSTOP): 60 s, 30 s and 90 s for 10 minutes; scaled down
    for short runs so at least two kills, the stop and a few big prompts still happen."""
    kill = min(60.0, max(5.0, duration_s / 3))
    return kill, kill / 2, min(1.5 * kill, duration_s / 2)


def run(duration_s: float = 600.0, kill_interval_s: float | None = None, big_interval_s: float | None = None,
        stop_at_s: float | None = None, stop_s: float = 3.0, concurrency: int = 6, bad_interval_s: float = 0.2,
        health_interval_s: float = 0.5, rss_interval_s: float = 10.0, time_scale: float = 1.0,
        max_requests: int = 200_000, seed: int = 0) -> dict[str, Any]:
    kill_d, big_d, stop_d = default_intervals(duration_s)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvrouter-soak-") as tmp:
        wlog = stack.enter_context(open(os.path.join(tmp, "workers.log"), "wb"))
        plog_path = os.path.join(tmp, "proxy.log")
        plog = stack.enter_context(open(plog_path, "wb"))
        workers = [SimProc(f"w{i}", time_scale, wlog) for i in range(3)]
        for w in workers:
            stack.callback(w.close)

        async def start_all() -> None:
            await asyncio.gather(*(w.start() for w in workers))

        asyncio.run(start_all())
        port, admin = free_port(), free_port()
        args = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--admin-port", str(admin), "--tenant-header", TENANT_HEADER, "--log-level", "warning"]
        for w in workers:
            args += ["--worker", w.spec]
        proxy = stack.enter_context(running(args, port_open(port), 30, "kvrouter serve", stderr=plog))
        soak = Soak(f"http://127.0.0.1:{port}", workers, proxy.pid, duration_s,
                    kill_interval_s or kill_d, big_interval_s or big_d, stop_d if stop_at_s is None else stop_at_s,
                    stop_s, concurrency, bad_interval_s, health_interval_s, rss_interval_s, max_requests, seed)
        try:
            asyncio.run(soak.run())
        except RuntimeError as e:
            plog.flush()
            with open(plog_path, errors="replace") as fh:
                tail = fh.read()[-4000:]
            raise RuntimeError(f"{e}; the proxy's log ends:\n{tail}") from e

        async def scrape() -> str:
            async with aiohttp.ClientSession() as s, s.get(soak.url + "/metrics") as r:
                return await r.text()

        alive = proxy.poll() is None
        metrics_text = asyncio.run(scrape()) if alive else ""
        plog.flush()
        with open(plog_path, errors="replace") as fh:
            proxy_log = fh.read()
        return soak.report(metrics_text, alive, proxy_log)


def _print_table(res: dict[str, Any]) -> None:
    print(f"soak: {res['elapsed_s']} s, {res['requests']['total']} requests, verdict {res['verdict']}")
    print(f"{'category':<9}{'kind':<22}status counts")
    for cat in ("good", "bad"):
        for kind, statuses in sorted(res["requests"][cat].items()):
            counts = ", ".join(f"{s}: {n}" for s, n in statuses.items())
            print(f"{cat:<9}{kind:<22}{counts}")
    print(f"{'stream kind':<22}" + "".join(f"{e:>14}" for e in STREAM_ENDINGS[:4]))
    for kind, ends in res["streams"].items():
        print(f"{kind:<22}" + "".join(f"{ends[e]:>14}" for e in STREAM_ENDINGS[:4]))
    g, b = res["good"], res["bad_input"]
    print(f"bad input 5xx: {b['5xx']}; unexpected: {b['unexpected'] or 'none'}")
    print(f"good: {g['ok']} of {g['total']} ok; http 5xx {g['http_5xx']} ({g['http_5xx_away_from_faults']} away from "
          f"faults); streams ended in error {g['streams_ended_in_error']} "
          f"({g['streams_ended_in_error_away_from_faults']} away from faults)")
    big = res["big_prompt"]
    print(f"30 MB prompts: {big['sent']}, refusal ms p50 {big['ms_p50']} max {big['ms_max']}")
    h = res["health"]
    print(f"/health: {h['samples']} samples {h['status']}, p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, "
          f"max {h['max_ms']} ms")
    r = res["rss_mb"]
    print(f"proxy RSS MB: start {r['start']}, end {r['end']}, max {r['max']}, growth {r['growth']}")
    m = res["proxy_metrics"]
    print(f"proxy metrics: truncated {m['kvrouter_responses_truncated_total']}, retries "
          f"{m['kvrouter_retries_total']}, requests {m['kvrouter_requests_total']}")
    for k in res["faults"]["kills"]:
        print(f"kill {k['worker']} at {k['t']} s: {k['streams_in_flight']} streams in flight {k['stream_endings']}, "
              f"restarted in {k['restart_s']} s, {k['good_ok_after']} good ok after ({k['good_ok_on_it_after']} on it)")
    for s in res["faults"]["stops"]:
        print(f"SIGSTOP {s['worker']} at {s['t']} s, SIGCONT at {s['continued_at']} s")
    for w in res["warnings"]:
        print(f"warning: {w}")
    for f in res["failures"]:
        print(f"FAIL: {f}")
    print(f"verdict: {res['verdict']}")


def main(args: argparse.Namespace) -> int:
    duration = args.duration if args.duration is not None else (60.0 if args.quick else 600.0)
    res = run(duration_s=duration)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        _print_table(res)
    return 0 if res["verdict"] == "PASS" else 1
