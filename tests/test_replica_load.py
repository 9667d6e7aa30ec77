"""The shared-load core (router/load/exchange.py), pure: one replica's lifecycle publishes deltas, another folds
them, and its ``WorkerLoad`` counts the remote requests exactly as the source counts them; expiry and
heartbeats bound what a lost message or a dead replica can cost. Explicit ``now`` everywhere, no sockets."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from router.load import WorkerLoad
from router.load.exchange import Envelope, LoadExchange, pack_keys, unpack_keys
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore

BS = 16


def replica(name: str, workers: int = 2) -> tuple[RoutingCore, LoadExchange]:
    core = RoutingCore(RoutingConfig(policy="least_loaded", block_size=BS, seed=1))
    for i in range(workers):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    ex = LoadExchange(core.load, name, BS, silence_s=3.0, max_request_age_s=60.0)
    core.state.shared_load = ex
    return core, ex


def request(rid: str, blocks: int = 4, extra_tokens: int = 5, max_tokens: int = 32, base: int = 1000) -> RouteRequest:
    keys = [base + i for i in range(blocks)]
    return RouteRequest(rid, keys, blocks * BS + extra_tokens, BS, max_tokens)


def send(core: RoutingCore, req: RouteRequest, worker: str, now: float):  # type: ignore[no-untyped-def]
    decision = core.decide(req, now)
    return core.dispatch(req, decision, worker, now)


def same_load(a: WorkerLoad, b: WorkerLoad) -> bool:
    return (a.requests, a.pending_prefill_tokens, a.decoding, a.output_tokens, a.prompt_tokens, a.active_keys,
            a.tail_blocks) == (b.requests, b.pending_prefill_tokens, b.decoding, b.output_tokens, b.prompt_tokens,
                               b.active_keys, b.tail_blocks)


def test_replica_fold_counts_a_remote_request_through_its_lifecycle():
    a, ea = replica("a")
    b, eb = replica("b")
    handle = send(a, request("r1"), "w0", 0.0)
    assert eb.receive(ea.take_batch(), 0.1) == "a"
    wl = b.load.workers["w0"]
    mine = a.load.workers["w0"]
    assert (wl.requests, wl.pending_prefill_tokens, wl.prompt_tokens, wl.output_tokens) == (
        1, mine.pending_prefill_tokens, 4 * BS + 5, 32)
    assert wl.active_blocks == mine.active_blocks == 4 + 3  # four prompt blocks; the partial one and 32 outputs
    assert wl.shared_prefix_blocks([1000, 1001, 9]) == 2
    handle.first_token(0.2)
    eb.receive(ea.take_batch(), 0.3)
    assert (wl.pending_prefill_tokens, wl.decoding) == (0, 1)
    handle.complete(0.4)
    eb.receive(ea.take_batch(), 0.5)
    assert (wl.requests, wl.decoding, wl.active_blocks, wl.active_keys) == (0, 0, 0, {})
    assert ea.take_batch() is None  # nothing left to say


def test_replica_fold_moves_a_reassigned_request():
    a, ea = replica("a")
    b, eb = replica("b")
    handle = send(a, request("r1"), "w0", 0.0)
    handle.reassign("w1", 0.1)
    batch = ea.take_batch()
    kinds = [type(d).__name__ for d in _decode(batch).deltas]
    assert kinds == ["Dispatched", "Reassigned"]  # one delta for the move, not an end and a new dispatch
    eb.receive(batch, 0.2)
    assert b.load.workers["w0"].requests == 0
    assert b.load.workers["w1"].requests == 1
    assert b.load.workers["w1"].active_blocks == a.load.workers["w1"].active_blocks


def test_replica_fold_sees_the_remote_load_in_decisions():
    """The point of it: a replica routes away from the worker another replica has just loaded."""
    a, ea = replica("a")
    b, eb = replica("b")
    for i in range(3):
        send(a, request(f"r{i}", base=100 * i), "w0", 0.0)
    eb.receive(ea.take_batch(), 0.0)
    decision = b.decide(request("mine", base=9000), 0.1)
    assert decision.ranked[0] == "w1"
    assert {c.worker_id: c.inflight for c in decision.candidates} == {"w0": 3, "w1": 0}


def test_replica_heartbeat_drops_a_request_whose_end_was_lost():
    a, ea = replica("a")
    b, eb = replica("b")
    h1 = send(a, request("r1"), "w0", 0.0)
    send(a, request("r2", base=5000), "w0", 0.0)
    eb.receive(ea.take_batch(), 0.0)
    h1.complete(0.1)
    ea.take_batch()  # lost on the way
    assert b.load.workers["w0"].requests == 2
    eb.receive(ea.heartbeat(), 0.2)
    assert b.load.workers["w0"].requests == 1
    assert eb.peers["a"].gaps == 1 and eb.peers["a"].reconciled == 1
    assert same_load(b.load.workers["w0"], a.load.workers["w0"])


def test_replica_silent_for_silence_s_has_its_load_expired():
    a, ea = replica("a")
    b, eb = replica("b")
    send(a, request("r1"), "w0", 0.0)
    eb.receive(ea.take_batch(), 10.0)
    assert eb.expire(12.9) == []
    assert b.load.workers["w0"].requests == 1
    eb.receive(ea.heartbeat(), 12.9)  # alive: the silence clock restarts
    assert eb.expire(15.0) == []
    assert eb.expire(16.0) == ["a"]
    assert b.load.workers["w0"].requests == 0 and b.load.workers["w0"].active_blocks == 0
    assert eb.peers == {}


def test_replica_request_older_than_the_bound_is_dropped():
    a, ea = replica("a")
    b, eb = replica("b")
    send(a, request("old"), "w0", 0.0)
    eb.receive(ea.take_batch(), 0.0)
    send(a, request("new", base=7000), "w0", 50.0)
    eb.receive(ea.take_batch(), 50.0)
    eb.receive(ea.heartbeat(), 61.0)
    eb.expire(61.0)
    assert b.load.workers["w0"].requests == 1
    assert "a/new" in b.load.inflight and eb.stats.requests_expired == 1


def test_replica_restarted_with_a_new_incarnation_drops_its_old_requests():
    a, ea = replica("a")
    b, eb = replica("b")
    send(a, request("r1"), "w0", 0.0)
    eb.receive(ea.take_batch(), 0.0)
    a2, ea2 = replica("a")  # the same replica id, a new process
    send(a2, request("r2", base=3000), "w1", 1.0)
    eb.receive(ea2.take_batch(), 1.0)
    assert b.load.workers["w0"].requests == 0 and b.load.workers["w1"].requests == 1
    assert eb.stats.restarts == 1


def test_replica_ignores_its_own_echo_and_counts_malformed_envelopes():
    a, ea = replica("a")
    send(a, request("r1"), "w0", 0.0)
    assert ea.receive(ea.take_batch(), 0.0) is None
    assert a.load.workers["w0"].requests == 1  # not counted twice
    assert ea.receive(b"\x93not an envelope", 0.0) is None
    assert ea.stats.malformed == 1


def test_replica_farewell_drops_everything_at_once():
    a, ea = replica("a")
    b, eb = replica("b")
    send(a, request("r1"), "w0", 0.0)
    eb.receive(ea.take_batch(), 0.0)
    eb.receive(ea.farewell(), 0.1)
    assert b.load.workers["w0"].requests == 0


def test_replica_drain_reaches_the_others():
    _, ea = replica("a")
    b, eb = replica("b")
    eb.on_drain = lambda wid, draining: b.set_draining(wid, draining)
    ea.local_drained("w1", True)
    eb.receive(ea.take_batch(), 0.0)
    assert b.endpoints["w1"].draining


def _decode(data: bytes) -> Envelope:
    import msgspec

    return msgspec.msgpack.decode(data, type=Envelope)


def test_replica_keys_pack_as_little_endian_uint64():
    keys = [0, 1, (1 << 64) - 1, 0x0102030405060708]
    packed = pack_keys(keys)
    assert packed[8:16] == b"\x01" + b"\x00" * 7 and packed[24:32] == bytes(range(8, 0, -1))
    assert list(unpack_keys(packed)) == keys


ops = st.lists(st.tuples(st.sampled_from(["dispatch", "first", "complete", "fail", "reassign", "lose", "beat"]),
                         st.integers(0, 5), st.integers(0, 2)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_replica_fold_equals_the_source_after_any_lifecycle(script):
    """Whatever one replica's requests do, and whichever batches are lost, the other's fold equals the source's
    own accounting once a heartbeat has come, request by request, except a request whose dispatch was lost
    (the one thing a heartbeat cannot rebuild: it is missing, never wrong)."""
    a, ea = replica("a", workers=3)
    b, eb = replica("b", workers=3)
    handles = {}
    now = 0.0
    for op, n, w in script:
        now += 0.01
        rid = f"r{n}"
        h = handles.get(rid)
        if op == "dispatch" and (h is None or h.ended):
            handles[rid] = send(a, request(rid, blocks=n % 3 + 1, base=100 * (n % 2)), f"w{w}", now)
        elif h is not None and not h.ended:
            if op == "first":
                h.first_token(now)
            elif op == "complete":
                h.complete(now)
            elif op == "fail":
                h.fail(now)
            elif op == "reassign":
                h.reassign(f"w{w}", now)
        if op == "lose":
            ea.take_batch()
        elif op == "beat":
            eb.receive(ea.heartbeat(), now)
        elif (batch := ea.take_batch()) is not None:
            eb.receive(batch, now)
    eb.receive(ea.heartbeat(), now)

    def state(r):  # type: ignore[no-untyped-def]
        return (r.worker_id, r.prompt_tokens, r.uncached_tokens, r.max_tokens, list(r.keys), r.tail_blocks,
                r.first_token_at is not None)

    source = {rid: state(r) for rid, r in a.load.inflight.items()}
    folded = {rid.split("/", 1)[1]: state(r) for rid, r in b.load.inflight.items()}
    assert set(folded) <= set(source)
    assert {rid: source[rid] for rid in folded} == folded
    assert eb.peers["a"].missing == len(source) - len(folded)
    if len(folded) == len(source):  # nothing missing: every worker's load is the source's, exactly
        for wid in ("w0", "w1", "w2"):
            assert same_load(b.load.load(wid), a.load.load(wid)), wid


def test_replica_batches_fit_the_transports_limit():
    a, ea = replica("a")
    b, eb = replica("b")
    for i in range(40):
        send(a, request(f"r{i}", blocks=64, base=1000 * i), "w0", 0.0)
    whole = len(ea.heartbeat())  # everything in one envelope: the size to stay under
    for i in range(40, 80):
        send(a, request(f"r{i}", blocks=64, base=1000 * i), "w0", 0.0)
    limit = whole // 4
    batches = []
    while (data := ea.take_batch(limit)) is not None:
        batches.append(data)
    assert len(batches) > 1 and all(len(d) <= limit for d in batches)
    for d in batches:
        eb.receive(d, 0.0)
    assert eb.peers["a"].gaps == 0  # heard from its second envelope on: the split batches come in sequence
    beat = ea.heartbeat(max_bytes=100)  # too big with its list of 80 requests: a bare sign of life
    assert _decode(beat).live is None and len(beat) <= 100
    eb.receive(beat, 0.1)
    assert b.load.workers["w0"].requests == 40  # the 40 of the envelope that was skipped stay missing
    eb.receive(ea.heartbeat(), 0.2)
    assert eb.peers["a"].missing == 40 and b.load.workers["w0"].requests == 40


def test_replica_routes_a_new_prefix_after_the_others_dispatch_of_it():
    """Replica a sends a new prefix to w1 and it is prefilled there; before any engine event, replica b's next
    request with that prefix follows it (the speculative prefix travels with the dispatch), where by load alone
    it would go to w0."""
    picks = {}
    for shared_prefix in (False, True):
        a, ea = replica("a")
        b, eb = replica("b")
        for core in (a, b):
            core.profile = RoutingCore(RoutingConfig(policy="precise", block_size=BS, seed=1)).profile
        if shared_prefix:
            eb.on_remote_dispatch = lambda wid, keys, now, b=b: b.state.speculative.record(wid, keys, now) and None
        send(b, request("busy", base=50_000), "w1", 0.0)  # load on w1: by load alone, w0
        send(a, request("first", blocks=256, base=777), "w1", 0.0).first_token(0.05)  # prefilled, no event yet
        eb.receive(ea.take_batch(), 0.05)
        decision = b.decide(request("second", blocks=256, base=777), 0.1)
        picks[shared_prefix] = (decision.ranked[0],
                                next(c for c in decision.candidates if c.worker_id == "w1").speculative)
    assert picks == {False: ("w0", 0), True: ("w1", 256)}
