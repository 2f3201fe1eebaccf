"""A service process's heap (pdserve/heap.py, pdserve/lifecycle.py): once it announces itself
its start-up objects are out of the collector's passes, and every pass is timed by
generation. In-process: the test restores the collector's state after each."""

from __future__ import annotations

import asyncio
import gc
import io
from contextlib import redirect_stdout

import pytest

from pdserve import heap, lifecycle
from pdserve.telemetry import REGISTRY


@pytest.fixture
def restored_collector():
    callbacks = list(gc.callbacks)
    yield
    gc.unfreeze()
    gc.callbacks[:] = callbacks
    lifecycle._service_process = False


def _passes(generation: int) -> float:
    return (
        REGISTRY.get_sample_value("pdserve_gc_pause_seconds_count", {"generation": str(generation)})
        or 0.0
    )


def test_a_service_freezes_its_start_up_heap_when_it_announces_itself(restored_collector) -> None:
    built = [[i] for i in range(50_000)]  # start-up state: lists, tracked by the collector
    seen: dict[str, int] = {}

    async def service(stop: asyncio.Event) -> None:
        seen["before"] = gc.get_freeze_count()
        lifecycle.announce_ready("probe", port=1)
        seen["after"] = gc.get_freeze_count()

    out = io.StringIO()
    with redirect_stdout(out):
        assert lifecycle.run(service) == 0
    assert lifecycle.parse_ready(out.getvalue()) == {"service": "probe", "port": 1}
    assert seen["before"] == 0
    assert seen["after"] >= len(built)  # everything alive then, the start-up state included
    assert all(not any(o is b for b in built[:3]) for o in gc.get_objects(generation=2))
    full = _passes(2)
    gc.collect()
    assert _passes(2) == full + 1  # the pass was timed, under its generation


def test_announcing_outside_a_service_process_freezes_nothing(restored_collector) -> None:
    with redirect_stdout(io.StringIO()):
        lifecycle.announce_ready("in-process", port=2)  # a test serving in its own process
    assert gc.get_freeze_count() == 0


def test_watching_twice_times_each_pass_once(restored_collector) -> None:
    heap.watch()
    heap.watch()
    before = _passes(2)
    gc.collect()
    assert _passes(2) == before + 1
