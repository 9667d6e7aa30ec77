"""``session-hash``: consistent (rendezvous) hashing on the request's session key, as Envoy's ring hash or
Nginx ``hash consistent``: a session stays on its worker while that worker is a candidate. No key: a seeded
shuffle, as a ring hash with no header spreads at random."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot


class SessionHash(Picker):
    type_name = "session-hash"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        session = snap.request.session
        if not session:
            ids = [c.worker_id for c in cands]
            self.rng.shuffle(ids)
            return ids
        weight = {c.worker_id: xxhash.xxh3_64_intdigest(f"{session}\x00{c.worker_id}".encode()) for c in cands}
        return sorted(weight, key=weight.__getitem__, reverse=True)
