"""``kvrouter bench index``: event ingest rate, prefix-match latency, index memory per block.

Ingest: realistic vLLM batches (16-block BlockStored events with token ids, block size 16, chained to
their parents, plus BlockRemoved of older blocks) are pre-encoded, then decoded and applied through the
real codec, feed and index on one core, the feed as the router runs it (telling the reuse statistics the keys
of every GPU removal; before 2026-12-02 the bench left that out) and the codec too (``raw_tokens``: token ids
read from their msgpack bytes into uint32s, not decoded to ints; since 2026-12-02 as well). The baseline,
measured in the same run, is the decode-only rate of the full decode (every field to Python objects: what the
issue's ratio was set against); beside it the decode that leaves token ids raw (the router's own, so ingest's
floor), and ingest through an index that does nothing (decode, feed and key computation: what no layout
removes).
``one_block_events``: the same for batches of eight one-block BlockStored events (what an engine publishes
while it decodes: a block per request every 16 tokens), where the per-event work outweighs the per-block work.
Match: 64 workers holding 1M blocks in total; worker j holds the first j/64 of the query prompt (so the
walk covers the whole prompt) plus filler; keys are computed beforehand, only ``KvIndex.match`` is timed.
Memory: bytes traced (tracemalloc: numpy's arrays included, with their spare capacity) per resident block,
as stores fill the index, and the most it reaches under steady eviction (``bytes_per_resident_block_churn``:
64 workers filled with 16-block events, then each event stored evicts its worker's oldest, until every block
was replaced three times: what an index of engines at their cache's capacity holds).

At scale (``--blocks 20000000 --workers 1000``, not part of the default run nor of the tests): the same index
built to that size (bulk stores, one per worker and prompt share), its memory per block and the match there.
``kvrouter bench index --blocks N --workers W [--layout compact|dicts]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from router.events.codec import BlockRemoved, BlockStored, EventBatch, decode_payload, encode_payload
from router.events.feed import IndexFeeder
from router.index import INDEX_LAYOUTS, KvIndex, Medium
from router.index.residency import store_chained
from router.keys import request_keys
from router.scheduling.reuse import ReuseTracker

BLOCK = 16


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def make_batches(n_batches: int, events_per_batch: int = 4, blocks_per_event: int = 16,
                 seed: int = 1, capacity: int = 4096) -> tuple[list[bytes], int]:
    """Encoded payloads and the number of block events they carry; past ``capacity`` live blocks each batch
    evicts the oldest ones."""
    rng = random.Random(seed)
    payloads: list[bytes] = []
    block_events = 0
    next_hash = 1
    live: list[int] = []
    for b in range(n_batches):
        events: list = []
        for _ in range(events_per_batch):
            hashes = list(range(next_hash, next_hash + blocks_per_event))
            next_hash += blocks_per_event
            parent = live[-1] if live and rng.random() < 0.7 else None
            tokens = [rng.randrange(32000) for _ in range(blocks_per_event * BLOCK)]
            events.append(BlockStored(hashes, parent, tokens, BLOCK, None, "GPU", None,
                                      [None] * blocks_per_event, 0, "full_attention"))
            live.extend(hashes)
            block_events += blocks_per_event
        if len(live) > capacity:  # steady state: evict as much as is stored
            gone, live = live[: blocks_per_event * 2], live[blocks_per_event * 2 :]
            events.append(BlockRemoved(gone, "GPU", 0))
            block_events += len(gone)
        payloads.append(encode_payload(EventBatch(float(b), events, 0)))
    return payloads, block_events


class _NullIndex(KvIndex):
    """An index that does nothing (every parent known): ingest through it is decode, the feed and the key
    computation alone, the part of ingest no index layout can take away."""

    def store(self, worker_id: str, engine_hashes: object, keys: object, medium: Medium) -> None:
        return None

    def remove(self, worker_id: str, engine_hashes: object, medium: Medium) -> int:
        return 0

    def key_of(self, worker_id: str, engine_hash: object) -> int:
        return 0

    def store_chain(self, worker_id: str, engine_hashes: object, token_ids: object, block_size: int,
                    parent_hash: object, medium: Medium) -> bool:
        return store_chained(self, worker_id, engine_hashes, token_ids, block_size, parent_hash, medium)  # keys only


def bench_ingest(rounds: int, n_batches: int, layout: type[KvIndex] = KvIndex, events_per_batch: int = 4,
                 blocks_per_event: int = 16) -> dict[str, float]:
    payloads, block_events = make_batches(n_batches, events_per_batch, blocks_per_event)
    decode_rates, raw_rates, ingest_rates, null_rates = [], [], [], []

    def ingest(index: KvIndex) -> float:
        feeder = IndexFeeder(index, block_size=BLOCK)
        feeder.on_gpu_evicted = ReuseTracker().evicted  # as the router's state attaches it (scheduling/state.py)
        gc.collect()
        t0 = time.perf_counter()
        for seq, p in enumerate(payloads):
            feeder.offer("w0", seq, decode_payload(p, raw_tokens=True), 0.0)  # as the subscriber decodes
        return block_events / (time.perf_counter() - t0)

    def decode(raw_tokens: bool) -> float:
        gc.collect()
        t0 = time.perf_counter()
        for p in payloads:
            decode_payload(p, raw_tokens)
        return block_events / (time.perf_counter() - t0)

    for _ in range(rounds):
        decode_rates.append(decode(False))
        raw_rates.append(decode(True))
        ingest_rates.append(ingest(layout()))
        null_rates.append(ingest(_NullIndex()))
    return {
        "ingest_block_events_per_s": statistics.median(ingest_rates),
        "decode_only_block_events_per_s": statistics.median(decode_rates),
        "decode_raw_tokens_block_events_per_s": statistics.median(raw_rates),
        "feed_and_keys_block_events_per_s": statistics.median(null_rates),
    }


def build_index(n_workers: int, total_blocks: int, prompts: dict[str, list[int]], seed: int = 2,
                layout: type[KvIndex] = KvIndex) -> KvIndex:
    rng = random.Random(seed)
    index = layout(capacity=total_blocks * 2)
    per_worker = total_blocks // n_workers
    next_hash = 1
    for j in range(n_workers):
        wid = f"w{j}"
        held = 0
        for keys in prompts.values():
            share = keys[: len(keys) * j // n_workers]
            index.store(wid, range(next_hash, next_hash + len(share)), share, Medium.GPU)
            next_hash += len(share)
            held += len(share)
        filler = max(0, per_worker - held)
        index.store(wid, range(next_hash, next_hash + filler),
                    [rng.getrandbits(64) for _ in range(filler)], Medium.GPU)
        next_hash += filler
    return index


def bench_match(n_workers: int, total_blocks: int, iters: int,
                layout: type[KvIndex] = KvIndex) -> tuple[dict[str, dict[str, float]], int]:
    rng = random.Random(3)
    prompts_tokens = {
        "8k": [rng.randrange(32000) for _ in range(8192)],
        "32k": [rng.randrange(32000) for _ in range(32768)],
    }
    prompts = {name: request_keys(t, BLOCK) for name, t in prompts_tokens.items()}
    index = build_index(n_workers, total_blocks, prompts, layout=layout)
    out: dict[str, dict[str, float]] = {}
    for name, keys in prompts.items():
        samples = []
        gc.collect()
        for _ in range(iters):
            t0 = time.perf_counter()
            index.match(keys)
            samples.append((time.perf_counter() - t0) * 1e3)
        key_samples = []
        for _ in range(max(10, iters // 10)):
            t0 = time.perf_counter()
            request_keys(prompts_tokens[name], BLOCK)
            key_samples.append((time.perf_counter() - t0) * 1e3)
        out[name] = {
            "p50_ms": statistics.median(samples),
            "p99_ms": _percentile(samples, 0.99),
            "keys_p50_ms": statistics.median(key_samples),
        }
    return out, len(index)


def bench_memory(n_blocks: int, layout: type[KvIndex] = KvIndex) -> float:
    rng = random.Random(4)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = layout(capacity=n_blocks * 2)
    step = 1000
    for j in range(0, n_blocks, step):
        index.store(f"w{j // step % 64}", range(j, j + step), [rng.getrandbits(64) for _ in range(step)],
                    Medium.GPU)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index)


def bench_churn_memory(blocks_per_worker: int, layout: type[KvIndex] = KvIndex, workers: int = 64) -> float:
    """The most traced bytes per resident block while engines evict as fast as they store. The events' hashes
    follow from their numbers (no list of them is kept: it would be traced with the index)."""
    rng = random.Random(6)
    per_event = 16
    events = blocks_per_worker // per_event

    def hashes(event: int) -> range:  # fill: worker w's i-th event is w * events + i; then one per worker a round
        return range(event * per_event, (event + 1) * per_event)

    def store(w: int, event: int) -> None:
        index.store(f"w{w}", hashes(event), [rng.getrandbits(64) for _ in range(per_event)], Medium.GPU)

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = layout(capacity=1 << 40)
    for w in range(workers):
        for i in range(events):
            store(w, w * events + i)
    worst = 0.0
    for r in range(3 * events):
        for w in range(workers):
            store(w, workers * events + r * workers + w)
            oldest = w * events + r if r < events else workers * events + (r - events) * workers + w
            index.remove(f"w{w}", hashes(oldest), Medium.GPU)
        worst = max(worst, (tracemalloc.get_traced_memory()[0] - before) / len(index))
    tracemalloc.stop()
    return worst


def bench_scale(total_blocks: int, n_workers: int, iters: int = 50, layout: type[KvIndex] = KvIndex) -> dict:
    """Build ``total_blocks`` over ``n_workers`` (as ``bench_match`` does), traced: bytes per resident block,
    build rate, and the match latency at that size."""
    rng = random.Random(3)
    prompts_tokens = {"8k": [rng.randrange(32000) for _ in range(8192)]}
    prompts = {name: request_keys(t, BLOCK) for name, t in prompts_tokens.items()}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    index = build_index(n_workers, total_blocks, prompts, layout=layout)
    build_s = time.perf_counter() - t0
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        index.match(prompts["8k"])
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"resident_blocks": len(index), "workers": n_workers,
            "bytes_per_resident_block": round(used / len(index), 1), "traced_bytes": used,
            "build_s": round(build_s, 1), "match_8k_p50_ms": round(statistics.median(samples), 3),
            "match_8k_p99_ms": round(_percentile(samples, 0.99), 3)}


def run_layout(layout: type[KvIndex], quick: bool, progress: Callable[[str], None]) -> dict:
    name = next(k for k, v in INDEX_LAYOUTS.items() if v is layout)
    progress(f"{name}: ingest")
    ingest = bench_ingest(rounds=3 if quick else 5, n_batches=200 if quick else 2000, layout=layout)
    # what a decoding engine publishes: a BlockStored of one block per request for every 16 tokens it decodes
    progress(f"{name}: ingest, one-block events")
    decode_phase = bench_ingest(rounds=3 if quick else 5, n_batches=1000 if quick else 10_000, layout=layout,
                                events_per_batch=8, blocks_per_event=1)
    progress(f"{name}: match")
    match, resident = bench_match(64, 50_000 if quick else 1_000_000, iters=50 if quick else 500, layout=layout)
    progress(f"{name}: memory")
    per_block = bench_memory(20_000 if quick else 200_000, layout=layout)
    churn = bench_churn_memory(320 if quick else 2000, layout=layout)
    return {
        "ingest_block_events_per_s": round(ingest["ingest_block_events_per_s"]),
        "decode_only_block_events_per_s": round(ingest["decode_only_block_events_per_s"]),
        "decode_raw_tokens_block_events_per_s": round(ingest["decode_raw_tokens_block_events_per_s"]),
        "feed_and_keys_block_events_per_s": round(ingest["feed_and_keys_block_events_per_s"]),
        "one_block_events": {k: round(v) for k, v in decode_phase.items()},
        "match_p50_ms": {k: round(v["p50_ms"], 4) for k, v in match.items()},
        "match_p99_ms": {k: round(v["p99_ms"], 4) for k, v in match.items()},
        "keys_p50_ms": {k: round(v["keys_p50_ms"], 4) for k, v in match.items()},
        "resident_blocks": resident,
        "workers": 64,
        "block_size": BLOCK,
        "bytes_per_resident_block": round(per_block, 1),
        "bytes_per_resident_block_churn": round(churn, 1),
    }


def _fraction(ingest: dict, baseline: str = "decode_only_block_events_per_s") -> float:
    return ingest["ingest_block_events_per_s"] / ingest[baseline]


def run(quick: bool = False, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Both index layouts in one run (the same batches, prompts and sizes): the default ``dicts`` layout's
    figures at the top level, and each layout's under ``layouts``."""
    layouts = {name: run_layout(cls, quick, progress) for name, cls in INDEX_LAYOUTS.items()}
    return {**layouts["dicts"], "layouts": layouts}


def main(args: argparse.Namespace) -> int:
    if getattr(args, "blocks", None):
        res = bench_scale(args.blocks, args.workers or 1000, layout=INDEX_LAYOUTS[args.layout or "compact"])
        if args.json:
            print(json.dumps(res, indent=2, sort_keys=True))
        else:
            print(f"{res['resident_blocks']:,} blocks over {res['workers']} workers: "
                  f"{res['bytes_per_resident_block']:.1f} bytes per resident block "
                  f"({res['traced_bytes'] / 2**30:.2f} GiB traced), built in {res['build_s']} s; "
                  f"match 8k p50 / p99 {res['match_8k_p50_ms']:.3f} / {res['match_8k_p99_ms']:.3f} ms")
        return 0
    res = run(quick=args.quick, progress=lambda s: None if args.json else print(f"... {s}", flush=True))
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    names = list(res["layouts"])
    by = res["layouts"]

    def cells(f: Callable[[dict], str]) -> str:
        return "".join(f"{f(by[n]):>24}" for n in names)

    rows = [("", "".join(f"{n:>24}" for n in names)),
            ("ingest (decode+apply), block-events/s, 1 core", cells(lambda r: f"{r['ingest_block_events_per_s']:,}")),
            ("  baseline: decode only, block-events/s", cells(lambda r: f"{r['decode_only_block_events_per_s']:,}")),
            ("  ingest as a fraction of decode only", cells(lambda r: f"{_fraction(r):.3f}x")),
            ("  as a fraction of the decode leaving token ids raw (its own)", cells(
                lambda r: f"{_fraction(r, 'decode_raw_tokens_block_events_per_s'):.3f}x")),
            ("  decode + feed + keys, an index doing nothing, fraction", cells(
                lambda r: f"{r['feed_and_keys_block_events_per_s'] / r['decode_only_block_events_per_s']:.3f}x")),
            ("ingest of one-block events (decoding engines), block-events/s", cells(
                lambda r: f"{r['one_block_events']['ingest_block_events_per_s']:,}")),
            ("  as a fraction of their decode only", cells(lambda r: f"{_fraction(r['one_block_events']):.3f}x")),
            ("  as a fraction of their decode leaving token ids raw", cells(
                lambda r: f"{_fraction(r['one_block_events'], 'decode_raw_tokens_block_events_per_s'):.3f}x"))]
    for k in ("8k", "32k"):
        rows.append((f"match {k} tokens, p50 / p99 ms (64 workers, {res['resident_blocks']:,} blocks)",
                     cells(lambda r, k=k: f"{r['match_p50_ms'][k]:.3f} / {r['match_p99_ms'][k]:.3f}")))
        rows.append((f"  block keys for {k} tokens, p50 ms (not in match)",
                     cells(lambda r, k=k: f"{r['keys_p50_ms'][k]:.3f}")))
    rows.append(("index memory, bytes per resident block", cells(lambda r: f"{r['bytes_per_resident_block']:.0f}")))
    rows.append(("  the most under steady eviction", cells(lambda r: f"{r['bytes_per_resident_block_churn']:.0f}")))
    width = max(len(r[0]) for r in rows)
    for name, val in rows:
        print(f"{name:<{width}}  {val}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--blocks", type=int, default=None, help="build this many blocks and measure (e.g. 20000000)")
    parser.add_argument("--workers", type=int, default=None, help="over this many workers (default 1000)")
    parser.add_argument("--layout", choices=sorted(INDEX_LAYOUTS), default=None, help="with --blocks (compact)")
    raise SystemExit(main(parser.parse_args()))
