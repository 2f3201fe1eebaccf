"""Runs a test body against a started :class:`Registry` (no network), for the registry tests."""

from __future__ import annotations

import asyncio

from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.caps import Limits
from pdserve.services.meta.registry import Registry


def run_with(body, backend=None, **limits) -> None:
    """``await body(registry)`` on a registry over ``backend`` (memory by default) with
    ``Limits(**limits)``, closed afterwards."""

    async def main() -> None:
        reg = Registry(backend or MemoryBackend(), limits=Limits(**limits))
        await reg.start()
        try:
            await body(reg)
        finally:
            await reg.close()

    asyncio.run(main())
