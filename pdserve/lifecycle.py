"""Explicit process lifecycle shared by every service: start, announce, serve, drain on
SIGTERM/SIGINT, stop.

A service prints one line ``PDSERVE_READY {json}`` on stdout once it serves, carrying the
addresses it actually bound (ports may be 0 = free port in the config). ``pdserve up`` and the
tests read that line instead of guessing ports or sleeping.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

READY_PREFIX = "PDSERVE_READY "


def announce_ready(service: str, **info: Any) -> None:
    """Prints the READY line (flushed) for ``service`` with what it bound."""
    sys.stdout.write(READY_PREFIX + json.dumps({"service": service, **info}) + "\n")
    sys.stdout.flush()


def parse_ready(line: str) -> dict[str, Any] | None:
    if not line.startswith(READY_PREFIX):
        return None
    return json.loads(line[len(READY_PREFIX) :])


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Runs ``main(stop)`` on a fresh event loop; SIGTERM and SIGINT set ``stop`` so that the
    service drains and returns. Returns the process exit code."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(runner())
    except KeyboardInterrupt:
        return 130
    return 0
