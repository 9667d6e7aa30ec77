"""``kvrouter worker sim``: run one simulated worker (HTTP + ZeroMQ) on the wall clock."""

from __future__ import annotations

import argparse
import logging
import os

from aiohttp import web

from router.scheduling.engine_profile import read_timing_file
from router.tokenizer import DEFAULT_TOKENIZER_DIR, PromptTokenizer
from workers.engine import EngineConfig, EngineModel, TimingModel
from workers.engine.block_pool import HASH_ALGOS
from workers.sim.publisher import KvEventPublisher
from workers.sim.server import SimWorker


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER_DIR),
                   help="tokenizer.json or a directory with it (and tokenizer_config.json)")
    p.add_argument("--events-endpoint", default=None,
                   help="KV-event PUB endpoint; binds if it has '*' or '::' (tcp://*:5557), else connects")
    p.add_argument("--replay-endpoint", default=None, help="replay ROUTER endpoint to bind (tcp://*:5558)")
    p.add_argument("--topic", default="", help="event topic (names the worker in the router's bind topology)")
    p.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank reported in every batch")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply modelled step times (0: no sleeping, as fast as possible)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier capacity in blocks (0: none)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step token budget (default: the --timing file's step_token_budget, else 8192)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--timing", default=None, help="YAML/JSON file overriding the timing model's coefficients")
    p.add_argument("--prefix-caching-hash-algo", default="native", choices=HASH_ALGOS,
                   help="the block hashes published, as vLLM's flag: native (the model's own, fast) or vLLM's "
                        "sha256 | sha256_cbor | xxhash | xxhash_cbor bit for bit, with vLLM's NONE_HASH: from "
                        "PYTHONHASHSEED when set, else a fixed seed (sha256*) or a random one (xxhash*)")


def build_worker(args: argparse.Namespace) -> SimWorker:
    tok = PromptTokenizer(args.tokenizer)
    spec = read_timing_file(args.timing) if args.timing else None
    timing = TimingModel(**spec.coefficients) if spec else TimingModel()
    budget = args.max_num_batched_tokens
    if budget is None:  # the file's (a calibrated engine's), else vLLM's GPU default
        budget = (spec.step_token_budget if spec else None) or 8192
    engine = EngineModel(EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size, cpu_blocks=args.cpu_blocks,
        max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, vocab_size=tok.vocab_size, timing=timing,
        hash_algo=args.prefix_caching_hash_algo, hash_seed=os.environ.get("PYTHONHASHSEED"),
    ))
    publisher = None
    if args.events_endpoint:
        publisher = KvEventPublisher(args.events_endpoint, args.replay_endpoint, args.topic, args.dp_rank)
    return SimWorker(engine, tok, args.model, publisher, args.time_scale, args.dp_rank)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def app_factory() -> web.Application:
        return build_worker(args).app()

    web.run_app(app_factory(), host=args.host, port=args.port, print=None, access_log=None)
    return 0
