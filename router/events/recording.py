"""Read (and write) recorded event files (the format of ``../shared/fixtures/vllm-0.32.0-cpu/kv_events.jsonl``).

One JSON object a line: ``{"kind": "pub", "t", "frames_b64"}`` (a live message),
``{"kind": "replay", "from_seq", "frames_b64"}`` (one replay reply) or ``{"kind": "request", ...}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Recorded:
    kind: str  # "pub" | "replay" | "request"
    t: float | None
    frames: list[bytes]
    raw: dict[str, Any]


def read_recording(path: str | Path) -> Iterator[Recorded]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                frames = [base64.b64decode(f) for f in rec.get("frames_b64", [])]
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a recording line: {e}") from None
            yield Recorded(rec.get("kind", "?"), rec.get("t"), frames, rec)


def recording_line(rec: Recorded) -> str:
    """One line of a recording (what ``read_recording`` reads back as ``rec``)."""
    raw = {k: v for k, v in rec.raw.items() if k not in ("kind", "t", "frames_b64")}
    out: dict[str, Any] = {"kind": rec.kind}
    if rec.t is not None:
        out["t"] = rec.t
    out.update(raw)
    if rec.frames or rec.kind != "request":
        out["frames_b64"] = [base64.b64encode(bytes(f)).decode("ascii") for f in rec.frames]
    return json.dumps(out)


def write_recording(path: str | Path, records: Iterable[Recorded]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(recording_line(rec) + "\n")
