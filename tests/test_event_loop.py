"""The frontends' event loop (router/frontends/event_loop.py) and request ids (router/frontends/openai.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import weakref

import pytest

from router import heap
from router.config import load_config
from router.frontends import event_loop
from router.frontends.openai import new_request_id


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.LOOP_ENV, "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert not event_loop.run(_loop_module()).startswith("uvloop")


def test_without_uvloop_the_standard_loop_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.LOOP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop.loop_factory() is None
    assert not event_loop.run(_loop_module()).startswith("uvloop")


def test_uvloop_runs_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv(event_loop.LOOP_ENV, raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


async def _collector_settings() -> tuple[tuple[int, ...], int, bool]:
    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a  # a reference cycle made inside: still collected
    probe = weakref.ref(a)
    del a, b
    gc.collect()
    return gc.get_threshold(), gc.get_freeze_count(), probe() is None


def test_the_frontends_run_the_collector_rarely_and_restore_it() -> None:
    """Inside ``run``: what was loaded before is frozen, the young are collected every YOUNG_THRESHOLD
    allocations, a cycle is still collected; after it the process's own settings are back."""
    before = gc.get_threshold(), gc.get_freeze_count()
    threshold, frozen, collected = event_loop.run(_collector_settings())
    assert threshold == (heap.YOUNG_THRESHOLD, *heap.OLDER_THRESHOLDS) != before[0]
    assert frozen > 0 and collected
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_the_loop_variable_is_not_a_config_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.LOOP_ENV, "asyncio")
    load_config(None)  # would raise on an unknown KVROUTER_ key


def test_request_ids_are_unique_hex_of_uuid_length() -> None:
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    mine = new_request_id()
    assert child[:16] != mine[:16]  # another prefix, so no id of the child's can be one of the parent's
