"""Peer routers run side by side with kvrouter: the SGLang model gateway (``pip install smg``)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.load import free_port, http_ok, running


class PeerUnavailable(RuntimeError):
    """The peer is not installed or did not start; the message says why."""


def smg_binary() -> str | None:
    local = Path(sys.executable).parent / "smg"
    return str(local) if local.exists() else shutil.which("smg")


@contextlib.contextmanager
def smg(worker_urls: list[str], policy: str = "cache_aware", timeout: float = 60.0) -> Iterator[str]:
    """Run ``smg launch`` in front of ``worker_urls`` on loopback; yields its base URL once it routes."""
    binary = smg_binary()
    if binary is None:
        raise PeerUnavailable("smg is not installed (pip install smg, or pip install -e '.[bench]')")
    port, prom = free_port(), free_port()
    cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
           "--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    body = b'{"model": "sim-model", "prompt": "ready?", "max_tokens": 1}'
    try:  # ready when it has discovered the workers and routes a request
        with running(cmd, http_ok(url + "/v1/completions", body), timeout, "smg", stderr=subprocess.DEVNULL):
            yield url
    except RuntimeError as e:
        raise PeerUnavailable(f"smg did not start routing within {timeout:.0f} s: {e}") from None
