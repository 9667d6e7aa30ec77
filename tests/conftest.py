from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FIXTURE = SHARED / "fixtures" / "vllm-0.32.0-cpu" / "kv_events.jsonl"
TRACE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"


def need_shared(path: Path) -> Path:
    """Skip (only outside this project's CI, where ../shared is always present) when shared data is absent."""
    if not path.exists():
        pytest.skip(f"{path} absent: ../shared is provided beside the checkout in this project's CI")
    return path


@pytest.fixture
def fixture_path() -> Path:
    return need_shared(FIXTURE)
