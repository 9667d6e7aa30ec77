"""Read recorded event files (the format of ``../shared/fixtures/vllm-0.32.0-cpu/kv_events.jsonl``).

One JSON object a line: ``{"kind": "pub", "t", "frames_b64"}`` (a live message),
``{"kind": "replay", "from_seq", "frames_b64"}`` (one replay reply) or ``{"kind": "request", ...}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
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
