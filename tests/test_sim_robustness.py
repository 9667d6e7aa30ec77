"""Issue 13: inputs that must not stop the simulator or the recording replay, and must be counted."""

import argparse
import json

import pytest

from router.events.codec import BlockStored, EventBatch, encode_message
from router.events.recording import Recorded, read_recording, write_recording
from router.events.replay_file import replay_file
from sim import cli
from sim.runner import SimConfig, Simulation, summarise
from sim.workload import mooncake
from workers.engine import EngineConfig

MAX_LEN = 4096
ENGINE = EngineConfig(num_gpu_blocks=2000, block_size=16, max_model_len=MAX_LEN)


def _trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(long_input=5000):
    """Mooncake rows (timestamps in ms, 512-token hash ids); row 3 is longer than ``MAX_LEN``."""
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 100, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 200, "input_length": 900, "output_length": 20, "hash_ids": [0, 3]},
        {"timestamp": 300, "input_length": long_input, "output_length": 20,
         "hash_ids": [0, *range(10, 10 + -(-long_input // 512) - 1)]},
        {"timestamp": 400, "input_length": 1024, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 2000, "output_length": 20, "hash_ids": [0, 4, 5, 6]},
    ]
    return rows


@pytest.mark.parametrize("policy", ["round_robin", "precise"])
def test_a_trace_request_over_max_model_len_is_rejected_and_the_run_goes_on(tmp_path, policy):
    reqs = mooncake(_trace(tmp_path, _rows()))
    long_id = "r3"
    assert next(r for r in reqs if r.request_id == long_id).num_tokens + 20 > MAX_LEN
    sim = Simulation(reqs, SimConfig(workers=2, policy=policy, engine=ENGINE))
    res = sim.run()
    by_id = {r.request_id: r for r in res.records}
    assert set(by_id) == {r.request_id for r in reqs}
    bad = by_id[long_id]
    assert bad.outcome == "rejected" and "max_model_len" in (bad.error or "")
    assert bad.first_token_at is None and bad.finished_at is None and bad.output_tokens == 0 and bad.ttft is None
    for rid, rec in by_id.items():
        if rid != long_id:
            assert rec.outcome == "routed" and rec.finished_at is not None and rec.output_tokens == 20
    s = summarise(res)
    assert s["rejected"] == 1 and s["completed"] == len(reqs) - 1 and s["requests"] == len(reqs)
    assert s["shed"] == 0
    # the rejected prompt was never computed anywhere, and the router holds nothing for it afterwards
    assert sum(res.per_worker_prompt_tokens.values()) == sum(r.num_tokens for r in reqs if r.request_id != long_id)
    assert all(sim.core.load.load(w).requests == 0 for w in sim.ids)


def test_a_request_bigger_than_the_kv_cache_is_rejected_too(tmp_path):
    # under max_model_len, but more KV blocks than one engine has: the engine model refuses it as well
    engine = EngineConfig(num_gpu_blocks=200, block_size=16, max_model_len=MAX_LEN)  # 3,200 tokens of KV
    reqs = mooncake(_trace(tmp_path, _rows(long_input=3500)))
    s = summarise(Simulation(reqs, SimConfig(workers=2, policy="least_loaded", engine=engine)).run())
    assert s["rejected"] == 1 and s["completed"] == len(reqs) - 1


def _cli(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(argv))


def test_cli_reports_rejected_requests_per_policy(tmp_path, capsys):
    path = _trace(tmp_path, _rows())
    base = ["--trace", str(path), "--workers", "2", "--policies", "round_robin,precise", "--block-size", "16",
            "--gpu-blocks", "2000", "--max-model-len", str(MAX_LEN), "--jitter", "0"]
    assert _cli([*base, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["policies"]) == {"round_robin", "precise"}
    for p in data["policies"].values():
        assert p["rejected"] == 1 and p["completed"] == 5 and p["requests"] == 6
    assert _cli(base) == 0
    out = capsys.readouterr().out
    assert "rejected" in out.splitlines()[1]  # a column of the table


# ---- kvrouter index replay ----------------------------------------------------------------------------

def _stored(hashes, parent, ts):
    return EventBatch(ts, [BlockStored(hashes, parent, list(range(16 * len(hashes))), 16)], 0)


def test_a_frame_whose_payload_alone_is_broken_counts_against_its_worker(tmp_path):
    seq2 = (2).to_bytes(8, "big")
    records = [
        Recorded("pub", 1.0, encode_message("w0", 0, _stored([11, 12], None, 1.0)), {}),
        Recorded("pub", 2.0, encode_message("w0", 1, _stored([13], 12, 2.0)), {}),
        Recorded("pub", 3.0, [b"w0", seq2, b"\xc1 not msgpack"], {}),  # topic and seq fine, payload garbage
        Recorded("pub", 4.0, [b"\xff\xfe", seq2, b"\xc1"], {}),  # a topic that is not utf-8: names no one
        Recorded("pub", 5.0, [b"w0", b"\x00" * 7, b"\xc1"], {}),  # a short seq frame: not a frame of w0's
        Recorded("pub", 6.0, encode_message("w1", 0, _stored([21], None, 6.0)), {}),  # replay goes on after
    ]
    path = tmp_path / "events.jsonl"
    write_recording(path, records)
    assert [r.frames for r in read_recording(path)] == [r.frames for r in records]  # the writer round-trips
    report = replay_file(path)
    workers = report.as_json()["workers"]
    assert workers["w0"]["malformed"] == 1 and workers["w0"]["gaps"] == 0
    assert workers["w0"]["events"] == {"BlockStored": 2} and workers["w0"]["blocks"]["GPU"] == 3
    assert workers["w1"]["malformed"] == 0 and workers["w1"]["blocks"]["GPU"] == 1
    assert report.unattributed_malformed == 2
