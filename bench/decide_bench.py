"""``kvrouter bench decide``: latency of one routing decision (precise policy), tokenization excluded.

Index: each worker holds 16K blocks; worker j holds the first j/N of the query prompt, so the match walks
the whole prompt. Load: every worker has requests in flight and fresh engine metrics, and reports a KV
capacity its requests in flight nearly fill, so the cost model runs its full path (duplicate-copy eviction
cost and a memory wait over every request in flight). Timed: ``RoutingCore.decide`` (filters, index match,
speculative match, estimates, ranking, explain), on block keys computed beforehand (their cost is reported
apart). Between decisions the request is dispatched to the chosen worker and completed (untimed), so each
decision also rebuilds that one worker's memory-release schedule, as it would live.

The 1,000-worker cells (``8k@1000``, ``32k@1000``; 256 workers with ``--quick``) are read against the 64-worker
ones of the same run: a decision's per-candidate work is what grows with the fleet. The cells of one prompt
size are built first and then timed in turns of ``CHUNK`` decisions each (after ``WARMUP`` untimed ones), so
that a change in the machine's speed during the run (2x within minutes on these shared machines) hits every
cell alike; before this the cells ran one after the other (a ``--baseline`` tree that predates it times them
so).

Every precise cell also reports the index match alone (``match_p50_ms``: ``index.match`` of the prompt's keys,
the part of a decision the router's scheduling code does not own) and the run names its index layout
(``index_layout``, the default: ``dicts``): at 1,000 workers the match is most of a decision. It also times the
request's accounting around the decision (``lifecycle_p50_ms``: ``dispatch`` to the chosen worker and
``completed``, a thousand dict operations for an 8K prompt's 512 blocks), on the request's path too.

Other profiles (``--policies``) are timed on the 64-worker cells beside precise: a profile without a
prefix-aware scorer never walks the index, so it must cost less. ``--baseline REV`` runs the same bench from
another commit (a git worktree, in a subprocess; timed by this tree's bench code on that commit's router package,
or by its own bench where its router is too old for this one) interleaved with this one, round by round, and
reports the medians of both and their ratio: machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.load import build_extensions, p99
from router.index import Medium
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore

BLOCK = 16
SIZES = {"8k": 8192, "32k": 32768}


def _core(n_workers: int, keys: list[int], blocks_per_worker: int, rng: random.Random,
          policy: str = "precise") -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy=policy, block_size=BLOCK, seed=0))
    h = 1
    for j in range(n_workers):
        wid = f"w{j}"
        core.upsert_endpoint(Endpoint(wid, f"10.0.{j // 250}.{j % 250}:8000"))
        share = keys[: len(keys) * j // n_workers]
        filler = [rng.getrandbits(64) for _ in range(max(0, blocks_per_worker - len(share)))]
        core.index.store(wid, range(h, h + len(share) + len(filler)), share + filler, Medium.GPU)
        h += len(share) + len(filler)
        for r in range(3):
            own = [rng.getrandbits(64) for _ in range(125)]  # 2,000 prompt tokens + 100 output: 132 blocks
            core.load.dispatch(f"{wid}-{r}", wid, 2000, 1000, 100, 0.0, keys=own, block_size=BLOCK)
        core.update_metrics(wid, EngineMetrics(1.0, 3.0, 0.5, scraped_at=0.0, cache_tokens=400 * BLOCK))
    return core


CHUNK = 25  # decisions a cell times in each of its turns
WARMUP = 5  # decisions each turn runs first, untimed: the turn's timed decisions meet caches as a run of them would


def _time_cells(cells: dict[str, RoutingCore], keys: list[int], n_tokens: int, iters: int,
                p50: dict[str, float], p99_ms: dict[str, float], match_p50: dict[str, float] | None = None,
                lifecycle_p50: dict[str, float] | None = None) -> None:
    """Time every cell's decisions, the cells taking turns ``CHUNK`` decisions at a time, so that the fleet
    sizes of one prompt meet the machine alike (their ratio is what the bench reports; on these shared
    machines the speed of the same code moved 2x within minutes). Each turn first runs ``WARMUP`` decisions
    untimed, so that the other cells' turns do not leave the timed ones a colder cache than a run of decisions
    on one fleet has. ``match_p50``: also the index match alone (``index.match`` of the prompt's keys), a
    decision's floor. ``lifecycle_p50``: the dispatch and completion of each timed decision's request."""
    samples: dict[str, list[float]] = {label: [] for label in cells}
    lifecycle: dict[str, list[float]] = {label: [] for label in cells}
    gc.collect()
    for start in range(0, iters, CHUNK):
        for label, core in cells.items():
            for i in range(start - WARMUP, min(iters, start + CHUNK)):
                req = RouteRequest(f"r{i}" if i >= start else f"warm{start}-{i}", keys, n_tokens, BLOCK, 128)
                t0 = time.perf_counter()
                d = core.decide(req, now=0.5)
                if i >= start:
                    samples[label].append((time.perf_counter() - t0) * 1e3)
                # as in a live router, the chosen worker's requests change before the next decision
                t0 = time.perf_counter()
                core.dispatch(req, d, d.chosen, now=0.5)
                core.completed(req.request_id, now=0.5)
                if i >= start:
                    lifecycle[label].append((time.perf_counter() - t0) * 1e3)
    for label, core in cells.items():
        times = sorted(samples[label])
        p50[label] = round(statistics.median(times), 4)
        p99_ms[label] = round(p99(times), 4)
        if lifecycle_p50 is not None:
            lifecycle_p50[label] = round(statistics.median(lifecycle[label]), 4)
        if match_p50 is not None and "/" not in label:
            alone = []
            for _ in range(max(10, iters // 8)):
                t0 = time.perf_counter()
                core.index.match(keys)
                alone.append((time.perf_counter() - t0) * 1e3)
            match_p50[label] = round(statistics.median(alone), 4)


def run(quick: bool = False, policies: tuple[str, ...] = ("precise",)) -> dict:
    rng = random.Random(5)
    workers = (8, 64) if quick else (8, 64, 256)
    wide = (256,) if quick else (1000,)  # a fleet of a thousand (its own 16K blocks each: 16M in the index)
    iters = 50 if quick else 400
    p50: dict[str, float] = {}
    p99_ms: dict[str, float] = {}
    match_p50: dict[str, float] = {}
    lifecycle_p50: dict[str, float] = {}
    blocks = 2000 if quick else 16_000
    for size_name, n_tokens in SIZES.items():
        tokens = [rng.randrange(32000) for _ in range(n_tokens)]
        keys = request_keys(tokens, BLOCK)
        cells = {f"{size_name}@{n}": _core(n, keys, blocks, rng) for n in workers}
        for n in wide:  # their own draws: the cells above draw exactly what the bench always drew
            cells[f"{size_name}@{n}"] = _core(n, keys, blocks, random.Random(11))
        other = random.Random(7)  # the precise cells above draw exactly what the bench always drew
        for policy in policies:
            if policy != "precise":
                cells[f"{size_name}@64/{policy}"] = _core(64, keys, blocks, other, policy)
        _time_cells(cells, keys, n_tokens, iters, p50, p99_ms, match_p50, lifecycle_p50)
        del cells
    return {"p50_ms": p50, "p99_ms": p99_ms, "match_p50_ms": match_p50, "lifecycle_p50_ms": lifecycle_p50,
            "iterations": iters, "block_size": BLOCK,
            "index_layout": RoutingConfig().index, "interleaved": CHUNK}


def _subprocess_run(tree: Path | None, quick: bool, policies: tuple[str, ...], bench_dir: Path | None = None) -> dict:
    """This bench run by a subprocess on ``tree``'s router package (None: this tree's). ``bench_dir``: a
    folder holding only this tree's ``bench`` package (a link), put first on the path, so that a baseline is
    timed by the same bench code as this tree; without it, ``tree``'s own bench runs."""
    own = bench_dir is None and tree is not None
    cwd = tree or Path(__file__).resolve().parents[1]
    path = [str(cwd)] if bench_dir is None else [str(bench_dir), str(cwd)]
    # first on the path (``python -c`` puts its working directory, ``tree``, before PYTHONPATH: without this the
    # baseline's own bench ran, not this tree's)
    code = (f"import sys\nsys.path[:0] = {path!r}\nimport json, router\n"
            "try:  # a commit from before bench/ left router/\n    from router.bench.decide_bench import run\n"
            "except ImportError:\n    from bench.decide_bench import run\n"
            f"r = run(quick={quick!r}" + (")" if own else f", policies={policies!r})") +
            "; r['router'] = router.__file__; r['bench'] = run.__code__.co_filename; print(json.dumps(r))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["router"].startswith(str(cwd)), f"ran {res['router']}, not {cwd}"
    if bench_dir is not None:  # timed by this tree's bench code, as asked
        assert res["bench"].startswith(str(bench_dir)), f"timed by {res['bench']}, not {bench_dir}"
    return res


def compare(baseline: str, quick: bool, rounds: int, policies: tuple[str, ...]) -> dict:
    """This tree and ``baseline`` (a git revision), interleaved ``rounds`` times; medians per cell and the ratio."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), baseline], check=True,
                       capture_output=True)
        bench_dir = Path(tmp) / "bench-code"  # this tree's bench alone: the baseline is timed the same way
        bench_dir.mkdir()
        (bench_dir / "bench").symlink_to(repo / "bench", target_is_directory=True)
        try:
            build_extensions(tree)
            try:
                _subprocess_run(tree, True, policies, bench_dir)
            except subprocess.CalledProcessError:  # a router too old for this bench: its own bench times it
                bench_dir = None  # type: ignore[assignment]
            runs: dict[str, list[dict]] = {"current": [], "baseline": []}
            for r in range(rounds):  # which goes first alternates: neither always meets the machine fresh
                for name in ("current", "baseline") if r % 2 == 0 else ("baseline", "current"):
                    runs[name].append(_subprocess_run(None, quick, policies) if name == "current"
                                      else _subprocess_run(tree, quick, policies, bench_dir))
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)
    out: dict = {"baseline": baseline, "rounds": rounds,
                 "baseline_bench": "this tree's" if bench_dir is not None else "its own",
                 "index_layout": runs["current"][0].get("index_layout")}
    # the baseline is timed by this tree's bench (unless its router is too old for it): each stat has its own
    # baseline; a bench older than a stat (its own bench timing it) leaves that stat's baseline out
    for stat in ("p50_ms", "p99_ms", "match_p50_ms", "lifecycle_p50_ms"):
        out[stat] = {}
        for label in runs["current"][0].get(stat, ()):
            cur = statistics.median(r[stat][label] for r in runs["current"])
            base = [r[stat][label] for r in runs["baseline"] if label in r.get(stat, ())]
            entry = {"current": round(cur, 4)}
            if base:
                entry["baseline"] = round(statistics.median(base), 4)
                entry["ratio"] = round(cur / entry["baseline"], 3)
            out[stat][label] = entry
    return out


def main(args: argparse.Namespace) -> int:
    policies = tuple(getattr(args, "policies", None) or ["precise", "round_robin", "random"])
    if getattr(args, "baseline", None):
        res = compare(args.baseline, args.quick, args.rounds or 3, policies)
        if args.json:
            print(json.dumps(res, indent=2, sort_keys=True))
            return 0
        print(f"baseline {res['baseline']}, {res['rounds']} interleaved rounds, medians")
        print(f"{'prompt@workers':<26}{'p99 ms':>10}{'baseline':>10}{'ratio':>8}{'lifecycle':>11}{'baseline':>10}"
              f"{'ratio':>8}")
        nan = {"current": float("nan")}
        for label, e in res["p99_ms"].items():
            life = res["lifecycle_p50_ms"].get(label, nan)
            print(f"{label:<26}{e['current']:>10.3f}{e.get('baseline', float('nan')):>10.3f}"
                  f"{e.get('ratio', float('nan')):>8.3f}{life['current']:>11.3f}"
                  f"{life.get('baseline', float('nan')):>10.3f}{life.get('ratio', float('nan')):>8.3f}")
        return 0
    res = run(quick=args.quick, policies=policies)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"index layout {res['index_layout']}")
    print(f"{'prompt@workers':<20}{'p50 ms':>10}{'p99 ms':>10}{'lifecycle':>11}{'match p50':>11}")
    for label in res["p50_ms"]:
        match = res["match_p50_ms"].get(label)
        print(f"{label:<20}{res['p50_ms'][label]:>10.3f}{res['p99_ms'][label]:>10.3f}"
              f"{res['lifecycle_p50_ms'][label]:>11.3f}" + (f"{match:>11.3f}" if match is not None else ""))
    return 0
