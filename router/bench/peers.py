"""Peer routers run side by side with kvrouter: the SGLang model gateway (``pip install smg``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from router.bench.load import free_port


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
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        body = b'{"model": "sim-model", "prompt": "ready?", "max_tokens": 1}'
        while True:  # ready when it has discovered the workers and routes a request
            try:
                req = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise PeerUnavailable(f"smg did not start routing within {timeout:.0f} s (exit {proc.poll()})")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
