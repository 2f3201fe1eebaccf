"""services/worker.py without processes: the slot limit and the load it reports."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.errors import ResourceExhausted
from pdserve.services.worker import SlotLimit, _load_proto


def test_slot_limit_refuses_beyond_the_limit_and_signals_every_change() -> None:
    async def main() -> None:
        slots = SlotLimit(1, "max_queue")
        async with slots.slot():
            assert slots.active == 1 and slots.changed.is_set()
            slots.changed.clear()
            with pytest.raises(ResourceExhausted, match="max_queue = 1"):
                async with slots.slot():
                    pass
            assert not slots.changed.is_set()  # a refused request changes nothing
        assert slots.active == 0 and slots.changed.is_set()

    asyncio.run(main())


def test_reported_load_is_the_slots_split_by_the_engine() -> None:
    def engine(running: int, queued: int):
        load = SimpleNamespace(running_requests=running, queue_length=queued, kv_usage=0.5)
        return SimpleNamespace(load=lambda: load)

    slots = SlotLimit(8, "max_queue")
    slots.active = 3
    load = _load_proto(engine(2, 0), slots)  # the engine has not queued the third one yet
    assert (load.running_requests, load.queue_length, load.kv_usage) == (2, 1, 0.5)
    slots.active = 0
    load = _load_proto(engine(1, 0), slots)  # the engine frees its slot a step later
    assert (load.running_requests, load.queue_length) == (0, 0)
