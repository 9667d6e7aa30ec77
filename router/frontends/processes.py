"""``kvrouter serve --processes N`` / ``kvrouter epp --processes N``: N router processes on one port, and the
shared load that keeps them one router.

One Python process routes on one core. Here a parent starts N children (``spawn``: nothing of the parent's
state is inherited), each a whole router: its own fleet (health probes, metric scrapes, a subscription to
every engine's KV events, so every index is exact by itself) and its own listening socket on the same port
(SO_REUSEPORT: the kernel spreads connections over them). What no child can see for itself is the load the
others put on each worker; they share it through ``LoadExchange`` deltas over Unix datagram sockets (or over
the NATS load bus when one is configured, each child then a replica of its own there), so each decision
counts every request in flight from the pod.

The parent only supervises: SIGTERM and SIGINT go to every child (each drains as a lone router does), a child
that dies is reported and restarted (at most once a second each), and the parent exits when all have.
Prometheus counters are aggregated over the children (prometheus_client's multiprocess mode: a directory of
per-process files the parent makes), so ``/metrics`` from any child is the pod's; admin and debug
(``/debug/decision``, ``/admin/workers``, ``/admin/drain``) are served by process 0 alone, and a drain there
reaches the others as a delta. docs/configuration.md says what each endpoint shows.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from router.config import RouterConfig
from router.frontends.event_loop import run, until_signalled
from router.frontends.metrics import MULTIPROC_ENV
from router.load.bus import IpcLoadBus, LoadBus, LoadSync, NatsLoadBus
from router.load.exchange import LoadExchange, sanitize_replica_id

if TYPE_CHECKING:
    from router.frontends.fleet import Fleet

log = logging.getLogger("kvrouter.processes")

RESTART_INTERVAL_S = 1.0
STOP_MARGIN_S = 5.0  # past its grace, what a child gets to close its sockets and exit before it is killed


@dataclass(frozen=True)
class ProcessSlot:
    """Which child this is, of how many, and where the siblings' load sockets are."""

    index: int
    count: int
    bus_dir: str
    replica_base: str

    @property
    def serves_admin(self) -> bool:
        return self.index == 0


def default_replica_id() -> str:
    return sanitize_replica_id(f"{socket.gethostname()}-{os.getpid()}")


def start_shared_load(fleet: Fleet, config: RouterConfig, slot: ProcessSlot | None) -> LoadSync | None:
    """The load exchange this router takes part in, not yet started: NATS when ``load_bus`` is set (each
    process its own replica), else the pod's ipc sockets when it is one of several processes, else none."""
    base = slot.replica_base if slot else (config.replica_id or default_replica_id())
    replica = f"{base}-p{slot.index}" if slot else base
    bus: LoadBus
    if config.load_bus:
        bus = NatsLoadBus(config.load_bus, replica)
    elif slot is not None:
        bus = IpcLoadBus(slot.bus_dir, slot.index, slot.count)
    else:
        return None
    core = fleet.core
    exchange = LoadExchange(core.load, replica, config.routing.block_size,
                            max_request_age_s=config.upstream_timeout_s + 60.0)
    exchange.on_drain = lambda wid, draining: fleet.drain(wid, draining)
    exchange.on_remote_dispatch = lambda wid, keys, now: core.state.speculative.record(wid, keys, now) and None
    core.state.shared_load = exchange
    return LoadSync(exchange, bus, clock=fleet.clock)


# ---- the children --------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the parent dies, even by SIGKILL, so no orphan keeps serving the port."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child(command: str, config: RouterConfig, slot: ProcessSlot, log_level: str) -> None:
    _die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s p{slot.index} %(name)s: %(message)s")
    if command == "serve":
        from router.frontends.proxy import run_proxy as runner
    else:
        from router.frontends.epp import run_epp as runner

    # SIGTERM drains it (a second cuts the drain short), as a lone router; SIGINT is the supervisor's to forward:
    # a terminal's Ctrl-C reaches the whole process group, and taken here too it would count as the second
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run(until_signalled(runner(config, slot=slot), (signal.SIGTERM,)))


# ---- the parent ----------------------------------------------------------------------------------------
def grace_s(command: str, config: RouterConfig) -> float:
    """How long a router of ``command`` lets its requests in flight finish once told to stop."""
    return config.http.grace_s if command == "serve" else config.epp.grace_s


def supervise(command: str, config: RouterConfig) -> int:
    """Run ``config.processes`` children of ``kvrouter COMMAND`` until SIGTERM/SIGINT; restart any that dies.
    Each signal is forwarded to every child as SIGTERM: the first drains them, a second cuts their drains short.
    Exits 0 once every child has exited by itself, 1 if one had to be killed (still running ``STOP_MARGIN_S``
    past its grace)."""
    count = config.processes
    ctx = multiprocessing.get_context("spawn")
    root = tempfile.mkdtemp(prefix="kvrouter-")
    bus_dir, metrics_dir = os.path.join(root, "load"), os.path.join(root, "metrics")
    os.makedirs(bus_dir)
    os.makedirs(metrics_dir)
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the children before they import prometheus_client
    base = config.replica_id or default_replica_id()
    level = logging.getLevelName(logging.getLogger().level)
    stopping = False

    def start(index: int) -> BaseProcess:
        slot = ProcessSlot(index, count, bus_dir, base)
        proc = ctx.Process(target=_child, args=(command, config, slot, level), name=f"kvrouter-{command}-{index}")
        proc.start()
        return proc

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs: list[BaseProcess] = []
    started_at: list[float] = []
    try:
        for i in range(count):
            if stopping:  # told to stop while starting: the children started have been told, none more starts
                break
            procs.append(start(i))
            started_at.append(time.monotonic())
        log.warning("kvrouter %s: %d processes (pids %s) on one port", command, count,
                    ", ".join(str(p.pid) for p in procs))
        while not stopping:
            wait([p.sentinel for p in procs], timeout=0.5)
            for i, p in enumerate(procs):
                if p.exitcode is None or stopping:
                    continue
                if time.monotonic() - started_at[i] < RESTART_INTERVAL_S:
                    continue  # at most one restart a second: a child that cannot start does not spin
                log.error("kvrouter %s process %d (pid %s) exited with %s: restarting it", command, i, p.pid,
                          p.exitcode)
                procs[i] = start(i)
                started_at[i] = time.monotonic()
        deadline = time.monotonic() + grace_s(command, config) + STOP_MARGIN_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [p for p in procs if p.exitcode is None]
        for p in late:
            log.error("kvrouter %s: %s still running %.0f s past its grace: killed", command, p.name, STOP_MARGIN_S)
            p.kill()
            p.join()
        return 1 if late else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(root, ignore_errors=True)
