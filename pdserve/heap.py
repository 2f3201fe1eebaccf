"""The Python heap of a service process: its start-up objects kept out of the garbage
collector's passes, and the collector's pauses measured.

A full collection walks every tracked object, and a service's event loop stands still while it
runs. Most of a service's objects are built at start and live as long as the process: the
router's tokenizer alone is about 320,000 (transformers' tokenizer classes, the chat template),
and a full pass over them took 175 ms on an idle core here, 380-510 ms beside two busy engines:
every request arriving meanwhile waited that long for its admission, a tenant's first token
included (2026-12-07, ``tests/router/fair_share_bench.py``). Once a service serves
(:func:`pdserve.lifecycle.announce_ready`), :func:`freeze_startup` moves those objects to the
collector's permanent generation (``gc.freeze()``, as vLLM's API server and engine core do), so
later passes walk only what requests create. Objects frozen are never collected: a start-up
cycle that becomes garbage later stays (there are none of note: start-up state lives as long as
the process).

:func:`watch` times every collection into ``pdserve_gc_pause_seconds`` by generation, so a
pause that holds requests shows on the dashboard, not only in a bench.
"""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import Histogram

from pdserve.telemetry import REGISTRY

log = logging.getLogger(__name__)

GC_PAUSE = Histogram(
    "pdserve_gc_pause_seconds",
    "Time the process stood still in a garbage collection pass, by generation (2 = full)",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
_BY_GENERATION = [GC_PAUSE.labels(str(g)) for g in range(3)]
_started = [0.0]


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    elif _started[0]:
        _BY_GENERATION[info["generation"]].observe(time.perf_counter() - _started[0])
        _started[0] = 0.0


def watch() -> None:
    """Times this process's collections into ``pdserve_gc_pause_seconds`` (idempotent)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def freeze_startup() -> int:
    """Collects what start-up left as garbage, then freezes every object alive: later passes
    skip them. Returns how many objects are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the collector's passes", frozen)
    return frozen
