"""Feed a recorded event file through the real decoder, feed and index (``kvrouter index replay``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.events.codec import SEQ_BYTES, MalformedFrame, decode_message, decode_replay_frames
from router.events.feed import IndexFeeder
from router.events.recording import read_recording
from router.events.subscriber import Identity, default_identity
from router.index import KvIndex


@dataclass
class ReplayReport:
    feeder: IndexFeeder
    replay_frames: int = 0
    unattributed_malformed: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        workers = {}
        for wid, f in sorted(self.feeder.feeds.items()):
            held = self.feeder.index.blocks_held(wid)
            workers[wid] = {
                "blocks": {m.name: n for m, n in held.items()},
                "events": dict(sorted(f.events.items())),
                "malformed": f.malformed,
                "gaps": f.gaps,
            }
        return {"workers": workers}


def replay_file(
    path: str | Path, block_size: int | None = None, identity: Identity = default_identity
) -> ReplayReport:
    """Apply every live message in order (no replay socket here: a gap clears the worker)."""
    report = ReplayReport(IndexFeeder(KvIndex(), block_size=block_size))
    clock = 0.0
    for rec in read_recording(path):
        if rec.t is not None:
            clock = rec.t
        if rec.kind == "request":
            report.requests.append(rec.raw)
        elif rec.kind == "replay":
            try:
                decode_replay_frames(rec.frames)
                report.replay_frames += 1
            except MalformedFrame:
                report.unattributed_malformed += 1
        elif rec.kind == "pub":
            try:
                msg = decode_message(rec.frames)
            except MalformedFrame:
                named = _worker_of_broken(rec.frames, identity)
                if named is None:
                    report.unattributed_malformed += 1
                else:
                    report.feeder.mark_malformed(named)
                continue
            worker = identity(msg.topic, msg.batch.data_parallel_rank)
            gap = report.feeder.offer(worker, msg.seq, msg.batch, clock)
            if gap is not None:
                report.feeder.fill_gap(gap, [], msg.batch, clock)
    return report


def _worker_of_broken(frames: list[bytes], identity: Identity) -> str | None:
    """The worker a frame that did not decode names: its topic, when that and its seq frame are well formed
    (the payload is what broke); ``None`` when the frame cannot name one."""
    if len(frames) < 2 or len(frames[1]) != SEQ_BYTES:
        return None
    try:
        topic = bytes(frames[0]).decode()
    except UnicodeDecodeError:
        return None
    return identity(topic, None)
