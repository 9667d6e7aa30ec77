"""A short fingerprint of one worker's residency, for checking that two replicas' indexes agree.

Order-independent (two replicas fed the same events hold the same rows, but a snapshot restore need not keep
a tie's order), and it covers what a decision reads: which engine hash is held on which medium under which
key, and how many copies. O(blocks log blocks): for admin calls and tests, never the request path.
"""

from __future__ import annotations

import hashlib

from router.index.residency import KvIndex


def residency_digest(index: KvIndex, worker_id: str) -> str:
    rows = sorted((int(e.medium), repr(e.engine_hash), e.key, e.count) for e in index.export_worker(worker_id))
    h = hashlib.blake2b(digest_size=12)
    for row in rows:
        h.update(repr(row).encode())
    return h.hexdigest()
