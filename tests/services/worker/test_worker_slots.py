"""services/worker/slots.py: the slot limit."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import ResourceExhausted
from pdserve.services.worker.slots import SlotLimit


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
