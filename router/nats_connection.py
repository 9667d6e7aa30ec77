"""One way to reach NATS for the event bus and the load bus: a connection that reconnects forever, whose
first connect is retried too (the bus may start after the router, or be down when it starts)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def connect_nats(url: str, name: str, *, retry_s: float = 0.5, while_down: str = "retrying",
                       **options: Any) -> Any:
    """``while_down``: what the caller does meanwhile, for the log line; ``options``: nats.connect's own."""
    import nats

    async def _error(e: Exception) -> None:
        log.debug("nats %s: %r", name, e)

    while True:
        try:
            return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=retry_s,
                                      connect_timeout=2, allow_reconnect=True, error_cb=_error, **options)
        except Exception as e:  # no servers yet: keep trying, as a reconnect would
            log.warning("NATS %s not reachable (%r): %s", url, e, while_down)
            await asyncio.sleep(retry_s)
