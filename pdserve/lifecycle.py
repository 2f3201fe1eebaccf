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
#: Whether this process is a service run by :func:`run` (not a test serving in-process).
_service_process = False


def announce_ready(service: str, **info: Any) -> None:
    """Prints the READY line (flushed) for ``service`` with what it bound. In a service
    process (:func:`run`), first keeps its start-up heap out of the collector's passes
    (:func:`pdserve.heap.freeze_startup`)."""
    if _service_process:
        from pdserve import heap

        heap.freeze_startup()
    sys.stdout.write(READY_PREFIX + json.dumps({"service": service, **info}) + "\n")
    sys.stdout.flush()


def parse_ready(line: str) -> dict[str, Any] | None:
    if not line.startswith(READY_PREFIX):
        return None
    return json.loads(line[len(READY_PREFIX) :])


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Runs ``main(stop)`` on a fresh event loop; SIGTERM and SIGINT set ``stop`` so that the
    service drains and returns. Returns the process exit code. The process's collections are
    timed (:func:`pdserve.heap.watch`) and its start-up heap frozen once it announces itself."""
    global _service_process
    from pdserve import heap

    _service_process = True
    heap.watch()

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


def run_child(
    service: str, cmd: list[str], ready: Callable[[], bool], timeout_s: float, **info: Any
) -> int:
    """Runs a program that is no pdserve service (``mooncake_master``, ``etcd``) as one: ``cmd``
    starts as this process's child, in its process group (stopping the group stops it too),
    its output on this process's stderr (the service's log); once ``ready()`` says it serves,
    the READY line of ``service`` carries ``info`` and the child's pid. Returns when the child
    exits (its code, at least 1), on SIGTERM/SIGINT after stopping it (0), or when it does
    not serve within ``timeout_s`` seconds (1, after stopping it)."""
    import subprocess
    import threading
    import time

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    child = subprocess.Popen(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)
    print(f"pdserve {service}: pid {child.pid}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    while not ready():
        if child.poll() is not None:
            return _exited(cmd[0], child)
        if stop.is_set():
            return _stop_child(child)
        if time.monotonic() > deadline:
            print(f"{cmd[0]} did not serve within {timeout_s:.0f}s", file=sys.stderr)
            _stop_child(child)
            return 1
        time.sleep(0.1)
    announce_ready(service, **info, pid=child.pid)
    while not stop.wait(0.2):
        if child.poll() is not None:
            return _exited(cmd[0], child)
    return _stop_child(child)


def _exited(program: str, child: Any) -> int:
    print(f"{program} exited with code {child.returncode}", file=sys.stderr)
    return child.returncode or 1


def _stop_child(child: Any) -> int:
    """SIGTERM, SIGKILL after 10 s; 0."""
    import subprocess

    if child.poll() is None:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0
