"""asyncio helpers the adapters share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to end: a ``stop()`` must not return while one still runs (it
    could touch a socket or a client being closed next). All are cancelled before the first wait, so a slow one
    does not keep the others running."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
