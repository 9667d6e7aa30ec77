"""In-flight load shared between router replicas (and the processes of one router): the deltas each one
publishes, and the fold of the others' into its own ``LoadTracker``. Pure: callers pass ``now``; no I/O.

Every replica accounts for the requests it dispatched (router/load/accounting.py). Alone, that is the whole
fleet's in-flight load; beside other replicas it is a fraction, and each would pile its requests onto the
worker the others have just filled. So each replica publishes what its lifecycle does (a dispatch with
everything the accounting needs: worker, prompt tokens, uncached tokens, max_tokens, the block keys packed as
little-endian uint64 bytes, the tail blocks; the first token; the end, served or failed alike; a reassign to
another worker), and folds the others' deltas into its tracker under ids of their own (``replica/request``),
so every ``WorkerLoad`` the scorers, filters and the objective read (requests, pending prefill, decoding,
active KV blocks, the release schedule) counts the fleet's requests, not one replica's. ``on_remote_dispatch``
hands a folded dispatch's keys to the adapter (the speculative prefixes: where a new prefix was just sent).

Envelopes carry a replica id, an incarnation (random per process start: a restarted replica's old requests
are dropped at its first message) and a per-replica sequence, so a lost message shows as a gap. A heartbeat
is an envelope listing the replica's requests in flight (id, worker, uncached tokens, whether decoding): the
fold is repaired to it, so a lost end, first token or reassign costs at most one heartbeat interval; only a
lost dispatch cannot be rebuilt (the list does not carry the block keys), and that request is missing from
the fold until it ends. Expiry bounds what a lost message or a dead replica can cost:
a replica silent for ``silence_s`` has all its requests dropped, and so does any remote request older than
``max_request_age_s``. Timing is each receiver's own clock (the time a delta arrives): clocks of other
processes or hosts are never compared.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from router.load.accounting import InFlight, LoadTracker

SEPARATOR = "/"  # remote request ids in the tracker: replica + SEPARATOR + its own id (local ids have none)


class Dispatched(msgspec.Struct, tag="d", array_like=True):
    """A request sent to ``worker_id`` (a second one for the same id replaces the first)."""

    request_id: str
    worker_id: str
    prompt_tokens: int
    uncached_tokens: int
    max_tokens: int
    keys: bytes  # the full prompt blocks' keys, uint64 little-endian
    tail_blocks: int
    predicted_ttft_s: float | None = None


class FirstToken(msgspec.Struct, tag="f", array_like=True):
    request_id: str


class Ended(msgspec.Struct, tag="e", array_like=True):
    """Completed or failed: either way it no longer loads the worker."""

    request_id: str


class Reassigned(msgspec.Struct, tag="r", array_like=True):
    """Moved to another worker (a retry, Envoy's fallback): same prompt, that worker's own uncached estimate."""

    request_id: str
    worker_id: str
    uncached_tokens: int
    predicted_ttft_s: float | None = None


class Drained(msgspec.Struct, tag="x", array_like=True):
    """An operator drained (or undrained) a worker on one replica (``/admin/drain``): every replica follows."""

    worker_id: str
    draining: bool


Delta = Dispatched | FirstToken | Ended | Reassigned | Drained


class Live(msgspec.Struct, array_like=True):
    """One request in flight as a heartbeat lists it: enough to repair a lost first token or reassign."""

    request_id: str
    worker_id: str
    uncached_tokens: int
    decoding: bool


class Envelope(msgspec.Struct, array_like=True):
    replica: str
    incarnation: int
    seq: int  # per replica and incarnation, from 0, +1 per envelope
    deltas: list[Delta] = []
    live: list[Live] | None = None  # a heartbeat: the replica's own requests in flight when it was sent


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Envelope).decode


def pack_keys(keys: Sequence[int]) -> bytes:
    a = array("Q", keys)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_keys(data: bytes) -> array[int]:
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


@dataclass
class Peer:
    """What this replica knows of another one."""

    incarnation: int
    last_seq: int
    last_heard: float
    requests: set[str] = field(default_factory=set)  # its ids, in flight in the fold
    gaps: int = 0  # envelopes lost (sequence numbers skipped)
    reconciled: int = 0  # requests a heartbeat repaired (an end, a first token or a move that was lost)
    missing: int = 0  # of its requests at its last heartbeat, those whose dispatch never arrived


@dataclass
class ExchangeStats:
    received: int = 0
    malformed: int = 0
    replicas_expired: int = 0
    requests_expired: int = 0  # older than max_request_age_s
    restarts: int = 0  # a known replica seen with a new incarnation


class LoadExchange:
    """One replica's side of the exchange: an outbox of its own deltas, and the fold of everyone else's.

    ``wake`` (optional) is called when the outbox turns non-empty, so an adapter can flush it soon (once per
    event-loop pass, however many deltas came in it)."""

    def __init__(self, tracker: LoadTracker, replica_id: str, block_size: int, *, silence_s: float = 3.0,
                 max_request_age_s: float = 900.0, incarnation: int | None = None) -> None:
        if SEPARATOR in replica_id:
            raise ValueError(f"replica id {replica_id!r} must not contain {SEPARATOR!r}")
        self.tracker = tracker
        self.replica_id = replica_id
        self.block_size = block_size
        self.silence_s = silence_s
        self.max_request_age_s = max_request_age_s
        self.incarnation = incarnation if incarnation is not None else random.getrandbits(63)
        self.peers: dict[str, Peer] = {}
        self.stats = ExchangeStats()
        self.wake: Callable[[], None] | None = None
        self.on_drain: Callable[[str, bool], None] | None = None  # another replica drained a worker
        # another replica sent these block keys to this worker (the speculative prefixes: a burst of one new
        # prefix then follows the first of it on every replica, before the engine's events say where it is)
        self.on_remote_dispatch: Callable[[str, Sequence[int], float], None] | None = None
        self._seq = 0
        self._outbox: list[Delta] = []
        self._local: set[str] = set()  # own requests in flight (published)

    # ---- this replica's own lifecycle (router/scheduling/lifecycle.py calls these) ------------------------
    def local_dispatched(self, request_id: str, r: InFlight) -> None:
        self._local.add(request_id)
        self._put(Dispatched(request_id, r.worker_id, r.prompt_tokens, r.uncached_tokens, r.max_tokens,
                             pack_keys(r.keys), r.tail_blocks, r.predicted_ttft_s))

    def local_reassigned(self, request_id: str, r: InFlight) -> None:
        self._put(Reassigned(request_id, r.worker_id, r.uncached_tokens, r.predicted_ttft_s))

    def local_first_token(self, request_id: str) -> None:
        self._put(FirstToken(request_id))

    def local_ended(self, request_id: str) -> None:
        if request_id in self._local:
            self._local.discard(request_id)
            self._put(Ended(request_id))

    def local_drained(self, worker_id: str, draining: bool) -> None:
        self._put(Drained(worker_id, draining))

    def _put(self, delta: Delta) -> None:
        self._outbox.append(delta)
        if len(self._outbox) == 1 and self.wake is not None:
            self.wake()

    def take_batch(self, max_bytes: int | None = None) -> bytes | None:
        """The deltas since the last batch as one envelope, or None when there are none. ``max_bytes``: the
        transport's limit; the first deltas that fit are taken (call again for the rest)."""
        if not self._outbox:
            return None
        n = len(self._outbox)
        while True:
            data = _encode(Envelope(self.replica_id, self.incarnation, self._seq, self._outbox[:n]))
            if max_bytes is None or len(data) <= max_bytes or n == 1:
                break
            n //= 2
        del self._outbox[:n]
        self._seq += 1
        return data

    def heartbeat(self, max_bytes: int | None = None) -> bytes:
        """An envelope with any pending deltas and the list of this replica's requests in flight (a request
        the tracker dropped without an end, its worker removed, is dropped here too). Over ``max_bytes`` it
        goes without the list: a sign of life that repairs nothing this time."""
        inflight = self.tracker.inflight
        self._local.intersection_update(inflight.keys())
        live = []
        for rid in self._local:
            r = inflight[rid]
            live.append(Live(rid, r.worker_id, r.uncached_tokens, r.first_token_at is not None))
        data = _encode(Envelope(self.replica_id, self.incarnation, self._seq, self._outbox, live))
        if max_bytes is not None and len(data) > max_bytes:
            data = _encode(Envelope(self.replica_id, self.incarnation, self._seq, self._outbox, None))
        self._outbox = []
        self._seq += 1
        return data

    def farewell(self) -> bytes:
        """The last envelope of a replica shutting down: nothing of it is in flight any more."""
        self._local.clear()
        data = _encode(Envelope(self.replica_id, self.incarnation, self._seq, [], []))
        self._outbox = []
        self._seq += 1
        return data

    # ---- the others' ----------------------------------------------------------------------------------
    def receive(self, data: bytes, now: float) -> str | None:
        """Fold one envelope; returns the replica it came from (None: this replica's own, or malformed)."""
        try:
            env = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.malformed += 1
            return None
        if env.replica == self.replica_id or SEPARATOR in env.replica:
            return None
        self.stats.received += 1
        peer = self.peers.get(env.replica)
        if peer is not None and peer.incarnation != env.incarnation:
            self._drop_peer(env.replica)  # restarted: what its old process had in flight is gone with it
            self.stats.restarts += 1
            peer = None
        if peer is None:
            peer = self.peers[env.replica] = Peer(env.incarnation, env.seq - 1, now)
        if env.seq > peer.last_seq + 1:
            peer.gaps += env.seq - peer.last_seq - 1
        peer.last_seq = max(peer.last_seq, env.seq)
        peer.last_heard = now
        prefix = env.replica + SEPARATOR
        for d in env.deltas:
            self._apply(peer, prefix, d, now)
        if env.live is not None:
            self._reconcile(peer, prefix, env.live, now)
        return env.replica

    def _reconcile(self, peer: Peer, prefix: str, live: list[Live], now: float) -> None:
        """Make the fold of ``peer`` what its heartbeat says: a request it no longer lists ended (its end was
        lost), one on another worker or with a first token moved or advanced (that delta was lost). One whose
        dispatch was lost cannot be rebuilt from a heartbeat: it is missing until it ends."""
        t = self.tracker
        listed = {x.request_id: x for x in live}
        for rid in [rid for rid in peer.requests if rid not in listed]:
            t.complete(prefix + rid, now)
            peer.requests.discard(rid)
            peer.reconciled += 1
        missing = 0
        for rid, x in listed.items():
            r = t.inflight.get(prefix + rid) if rid in peer.requests else None
            if r is None:
                missing += 1
                continue
            if r.worker_id != x.worker_id or r.uncached_tokens != x.uncached_tokens:
                decoding = r.first_token_at is not None
                t.dispatch(prefix + rid, x.worker_id, r.prompt_tokens, x.uncached_tokens, r.max_tokens, now,
                           r.predicted_ttft_s, r.keys, self.block_size, tail=r.tail_blocks)
                if decoding:
                    t.first_token(prefix + rid, now)
                peer.reconciled += 1
            if x.decoding and t.first_token(prefix + rid, now) is not None:
                peer.reconciled += 1
        peer.missing = missing

    def _apply(self, peer: Peer, prefix: str, d: Delta, now: float) -> None:
        t = self.tracker
        if type(d) is Dispatched:
            peer.requests.add(d.request_id)
            keys = unpack_keys(d.keys)
            t.dispatch(prefix + d.request_id, d.worker_id, d.prompt_tokens, d.uncached_tokens, d.max_tokens, now,
                       d.predicted_ttft_s, keys, self.block_size, tail=d.tail_blocks)
            if self.on_remote_dispatch is not None:
                self.on_remote_dispatch(d.worker_id, keys, now)
        elif type(d) is FirstToken:
            t.first_token(prefix + d.request_id, now)
        elif type(d) is Ended:
            peer.requests.discard(d.request_id)
            t.complete(prefix + d.request_id, now)
        elif type(d) is Drained:
            if self.on_drain is not None:
                self.on_drain(d.worker_id, d.draining)
        else:  # Reassigned
            r = t.inflight.get(prefix + d.request_id)
            if r is not None:
                t.dispatch(prefix + d.request_id, d.worker_id, r.prompt_tokens, d.uncached_tokens, r.max_tokens,
                           now, d.predicted_ttft_s, r.keys, self.block_size, tail=r.tail_blocks)

    def expire(self, now: float) -> list[str]:
        """Drop replicas silent for ``silence_s`` (with everything they had in flight) and remote requests
        older than ``max_request_age_s``; returns the replicas dropped."""
        gone = [rid for rid, p in self.peers.items() if now - p.last_heard > self.silence_s]
        for replica in gone:
            self._drop_peer(replica)
        self.stats.replicas_expired += len(gone)
        oldest = now - self.max_request_age_s
        for replica, peer in self.peers.items():
            prefix = replica + SEPARATOR
            for rid in list(peer.requests):
                r = self.tracker.inflight.get(prefix + rid)
                if r is None or r.dispatched_at < oldest:  # None: its worker was removed
                    self.tracker.complete(prefix + rid, now)
                    peer.requests.discard(rid)
                    self.stats.requests_expired += r is not None
        return gone

    def _drop_peer(self, replica: str) -> None:
        peer = self.peers.pop(replica)
        prefix = replica + SEPARATOR
        for rid in peer.requests:
            self.tracker.complete(prefix + rid, 0.0)

    # ---- queries ----------------------------------------------------------------------------------------
    def remote_requests(self) -> int:
        return sum(len(p.requests) for p in self.peers.values())

    def describe(self, now: float) -> dict[str, object]:
        """For /admin/workers and tests: who is heard, what of theirs is counted."""
        return {"replica": self.replica_id, "local_requests": len(self._local),
                "peers": {r: {"requests": len(p.requests), "last_heard_age_s": round(now - p.last_heard, 3),
                              "gaps": p.gaps, "reconciled": p.reconciled, "missing": p.missing}
                          for r, p in sorted(self.peers.items())},
                "stats": dataclasses.asdict(self.stats)}


def sanitize_replica_id(text: str) -> str:
    """A replica id usable as one NATS subject token and in remote request ids."""
    out = "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
    return out or "replica"


__all__ = ["Delta", "Dispatched", "Drained", "Ended", "Envelope", "FirstToken", "Live", "LoadExchange", "Peer",
           "Reassigned", "pack_keys", "sanitize_replica_id", "unpack_keys"]
