"""The ``kvrouter`` command line. Subcommands import their modules lazily so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _index_replay(args: argparse.Namespace) -> int:
    from router.events.replay_file import replay_file

    report = replay_file(args.file, block_size=args.block_size)
    data = report.as_json()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"{args.file}: {report.replay_frames} replay frames decoded, "
          f"{report.unattributed_malformed} unattributable malformed frames")
    for wid, w in data["workers"].items():
        blocks = ", ".join(f"{m}={n}" for m, n in w["blocks"].items())
        events = ", ".join(f"{t}={n}" for t, n in w["events"].items())
        print(f"worker {wid}: blocks[{blocks}] events[{events}] malformed={w['malformed']} gaps={w['gaps']}")
    return 0


def _bench_index(args: argparse.Namespace) -> int:
    from router.bench.index_bench import main as bench_main

    return bench_main(args)


def _worker_sim(args: argparse.Namespace) -> int:
    from workers.sim.cli import run

    return run(args)


def _bench_worker(args: argparse.Namespace) -> int:
    from router.bench.worker_bench import main as bench_main

    return bench_main(args)


def _bench_decide(args: argparse.Namespace) -> int:
    from router.bench.decide_bench import main as bench_main

    return bench_main(args)


def _sim(args: argparse.Namespace) -> int:
    from sim.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description="Cache-aware request router for LLM fleets.")
    sub = parser.add_subparsers(dest="command", required=True)

    index = sub.add_parser("index", help="inspect the KV block index").add_subparsers(dest="sub", required=True)
    rep = index.add_parser("replay", help="feed a recorded event file through the decoder and index")
    rep.add_argument("file", help="recorded events (JSONL, as ../shared/fixtures/*/kv_events.jsonl)")
    rep.add_argument("--block-size", type=int, default=None, help="expected engine block size (default: any)")
    rep.add_argument("--json", action="store_true", help="print JSON with stable keys")
    rep.set_defaults(handler=_index_replay)

    worker = sub.add_parser("worker", help="run a worker").add_subparsers(dest="sub", required=True)
    ws = worker.add_parser("sim", help="simulated vLLM worker (OpenAI API + KV events) on the engine model")
    from workers.sim.cli import add_arguments

    add_arguments(ws)
    ws.set_defaults(handler=_worker_sim)

    sp = sub.add_parser("sim", help="trace-replay simulator: compare policies on engine models")
    from sim.cli import add_arguments as sim_arguments

    sim_arguments(sp)
    sp.set_defaults(handler=_sim)

    bench = sub.add_parser("bench", help="benchmarks that print a table (or --json)")
    bsub = bench.add_subparsers(dest="sub", required=True)
    bi = bsub.add_parser("index", help="event ingest rate, match latency, index memory")
    bi.add_argument("--json", action="store_true")
    bi.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    bi.set_defaults(handler=_bench_index)
    bw = bsub.add_parser("worker", help="simulated worker requests/s at time-scale 0 on one core")
    bw.add_argument("--json", action="store_true")
    bw.add_argument("--quick", action="store_true")
    bw.set_defaults(handler=_bench_worker)
    bd = bsub.add_parser("decide", help="latency of one routing decision over 8/64/256 workers")
    bd.add_argument("--json", action="store_true")
    bd.add_argument("--quick", action="store_true")
    bd.set_defaults(handler=_bench_decide)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        parser.exit(2, f"kvrouter: error: {e.strerror}: {e.filename}\n")


if __name__ == "__main__":
    sys.exit(main())
