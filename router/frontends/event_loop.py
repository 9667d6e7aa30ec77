"""The event loop the router's frontends run on: uvloop's where it is installed, asyncio's otherwise.

uvloop is libuv under asyncio's API; aiohttp runs on it unchanged. The proxy spends a large part of its
time per request in the event loop's own Python (selector callbacks, transport writes, task steps): uvloop
does that work in C (docs/benchmarks.md, "Proxy overhead", has the measured difference). Its absence is no
error: ``KVROUTER_EVENT_LOOP=asyncio`` chooses the standard loop even where uvloop is installed (to compare the
two, or to rule the loop out when debugging).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from router.heap import rare_collections

T = TypeVar("T")
LOOP_ENV = "KVROUTER_EVENT_LOOP"  # "asyncio": the standard loop; anything else (or unset): uvloop when installed


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
