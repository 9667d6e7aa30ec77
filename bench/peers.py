"""Peer routers run side by side with kvrouter: the SGLang model gateway (``pip install smg``) and vllm-router (the
vLLM project's Rust router, in its own virtualenv ``.venv-vllm-router``, installed here when missing)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from bench.load import free_port, http_ok, running
from router.tokenizer import DEFAULT_TOKENIZER_DIR

ROOT = Path(__file__).resolve().parents[1]
VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_VENV = Path(os.environ.get("KVROUTER_VLLM_ROUTER_VENV", ROOT / ".venv-vllm-router"))


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


def ensure_vllm_router() -> Path:
    """The ``vllm-router`` console script, installing vllm-router into its own virtualenv when missing (as the
    engine tier installs vLLM into .venv-vllm): its pinned fastapi/uvicorn stay out of kvrouter's environment.
    ``PeerUnavailable`` when it cannot be installed (no wheel for this platform, no registry)."""
    binary = VLLM_ROUTER_VENV / "bin" / "vllm-router"
    if binary.exists():
        return binary
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_ROUTER_VENV)], check=True, capture_output=True)
        subprocess.run([str(VLLM_ROUTER_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", f"vllm-router=={VLLM_ROUTER_VERSION}"],
                       check=True, capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        out = getattr(e, "stderr", b"") or b""
        raise PeerUnavailable(f"vllm-router {VLLM_ROUTER_VERSION} could not be installed into {VLLM_ROUTER_VENV}: "
                              f"{e} {out.decode(errors='replace')[-500:]}") from None
    if not binary.exists():
        raise PeerUnavailable(f"vllm-router installed but {binary} is missing")
    return binary


@contextlib.contextmanager
def vllm_router(worker_urls: Sequence[str], policy: str = "kv_aware", event_endpoints: Sequence[str] = (),
                block_size: int = 16, tokenizer: str | Path = DEFAULT_TOKENIZER_DIR, timeout: float = 60.0,
                log: IO[bytes] | None = None, model: str = "sim-model") -> Iterator[str]:
    """Run vllm-router in front of ``worker_urls`` on loopback; yields its base URL once it routes.

    ``kv_aware`` subscribes to each worker's KV events (``event_endpoints``, one per worker, ``tcp://host:port``)
    and recomputes vLLM's block hashes from the prompt, tokenized with ``tokenizer`` (a directory with
    tokenizer.json): the workers must publish vLLM's own hashes (a simulated worker:
    ``--prefix-caching-hash-algo sha256``) or it credits no prefix. ``log``: where its output goes (``--log-level
    debug`` then: each decision's ``credited_prefix_tokens``)."""
    binary = ensure_vllm_router()
    port, prom = free_port(), free_port()
    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
           "--log-level", "debug" if log is not None else "warning"]
    if policy == "kv_aware":
        if len(event_endpoints) != len(worker_urls):
            raise ValueError("kv_aware needs one event endpoint per worker")
        for url, ev in zip(worker_urls, event_endpoints, strict=True):
            cmd += ["--kv-event-source", f"{url}={ev}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", str(tokenizer)]
    url = f"http://127.0.0.1:{port}"
    body = f'{{"model": "{model}", "prompt": "ready?", "max_tokens": 1}}'.encode()
    out = log if log is not None else subprocess.DEVNULL
    try:
        with running(cmd, http_ok(url + "/v1/completions", body), timeout, "vllm-router", stdout=out, stderr=out):
            yield url
    except RuntimeError as e:
        raise PeerUnavailable(f"vllm-router did not start routing within {timeout:.0f} s: {e}") from None
