"""The event loop the router's frontends run on: uvloop's where it is installed, asyncio's otherwise.

uvloop is libuv under asyncio's API; aiohttp runs on it unchanged. The proxy spends a large part of its
time per request in the event loop's own Python (selector callbacks, transport writes, task steps): uvloop
does that work in C (docs/benchmarks.md, "Proxy overhead", has the measured difference). Its absence is no
error: ``KVROUTER_EVENT_LOOP=asyncio`` chooses the standard loop even where uvloop is installed (to compare the
two, or to rule the loop out when debugging).

``until_signalled`` is how every server here stops: each serves until its task is cancelled and then drains
(not ready, no new connections, queued requests answered 429, requests in flight given their grace), so SIGTERM
and SIGINT only cancel the task. Kubernetes sends SIGTERM on every rollout, scale-down and eviction; without a
handler Python's default is to die at once, cutting every stream (issue 50, finding 5).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from router.heap import rare_collections

T = TypeVar("T")
LOOP_ENV = "KVROUTER_EVENT_LOOP"  # "asyncio": the standard loop; anything else (or unset): uvloop when installed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("kvrouter")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor when it is installed and not turned off, else None (asyncio's default)."""
    if os.environ.get(LOOP_ENV, "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    """What ``run`` will use: "uvloop" or "asyncio"."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks, with the collector run rarely (router/heap.py:
    what the process has loaded by now is frozen, the young collected every 50,000 allocations)."""
    with rare_collections(), asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def until_signalled(main: Awaitable[T], signals: Sequence[signal.Signals] = STOP_SIGNALS) -> T | None:
    """Await ``main`` (a server that serves until cancelled, then drains) in this task, with ``signals`` handled:
    the first cancels it, so it drains; a second cancels it again, cutting the drain short (an operator's or
    the kubelet's insistence). Returns ``main``'s result, or None once a signal stopped it; a cancellation that
    came from no signal is the caller's and propagates."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    received = 0

    def stop(sig: signal.Signals) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.warning("%s: draining (again to cut it short)", sig.name)
        else:
            log.warning("%s again: cutting the drain short", sig.name)
        task.cancel()

    for sig in signals:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await main
    except asyncio.CancelledError:
        if not received:
            raise
        return None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
