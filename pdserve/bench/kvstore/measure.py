"""What ``pdserve bench kvstore`` measures and how: one :class:`Row` per system, size and
mode, the timing of sequential operations, how many of them a size gets, and the median of
each figure across rounds."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes moved per (transport, size, direction) at most; bounds the run time of big sizes.
BYTES_BUDGET = 512 * 1024 * 1024
#: Bytes in one batch at most (a batch of 64 MiB objects has 4).
BATCH_BYTES = 256 * 1024 * 1024


@dataclass
class Row:
    # "pdserve/shm", "pdserve/tcp", "pdserve/tcp+sum", "pdserve/tcp-notok" (data tokens off),
    # "pdserve/mooncake", "mooncake-store", "memcpy", "tcp-plain", "tcp-plain-warm",
    # "disk-raw", "disk-raw-direct"
    system: str
    size: int  # bytes per object
    iterations: int  # operations timed per direction
    mode: str  # "single" or "batch"
    batch: int  # objects per operation (1 in single mode)
    put_gbps: float
    put_p50_us: float
    put_p99_us: float
    get_gbps: float
    get_p50_us: float
    get_p99_us: float
    rounds: int = 1  # rounds this row is the median of (iterations: summed over them)


def pct(samples: list[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` (nearest rank)."""
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(n: int, op: Callable[[int], object]) -> tuple[list[float], float]:
    """``op(0) .. op(n - 1)`` one after the other: each one's seconds, and the total."""
    lat = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t)
    return lat, time.perf_counter() - start


def timed_row(
    system: str,
    size: int,
    n: int,
    put: tuple[list[float], float],
    get: tuple[list[float], float],
    batch: int = 1,
) -> Row:
    """The row of ``n`` operations of ``batch`` objects of ``size`` bytes each way, from
    :func:`measure`'s results of the puts and the gets."""
    (pl, pt), (gl, gt) = put, get
    moved = size * batch * n
    return Row(
        system,
        size,
        n,
        "single" if batch == 1 else "batch",
        batch,
        moved / pt / 1e9,
        pct(pl, 0.5) * 1e6,
        pct(pl, 0.99) * 1e6,
        moved / gt / 1e9,
        pct(gl, 0.5) * 1e6,
        pct(gl, 0.99) * 1e6,
    )


def iterations_for(size: int, iterations: int) -> int:
    """Operations of ``size`` bytes each timed per direction."""
    return max(3, min(iterations, BYTES_BUDGET // size))


def batch_for(size: int, batch: int) -> int:
    """Objects per batch of ``size``-byte objects."""
    return max(1, min(batch, BATCH_BYTES // size))


def progress(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[bench kvstore] {msg}", file=sys.stderr, flush=True)


def fmt_size(n: int) -> str:
    """``n`` bytes as the table shows them (``4 KiB``, ``16 MiB``)."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """One row per (system, size, batch) over the rounds: each figure the median of that
    figure across the rounds that measured it, ``iterations`` their sum, ``rounds`` their
    count. The machines are noisy and the systems run one after the other: medians over
    alternating rounds keep one slow spell from deciding a ratio."""
    groups: dict[tuple[str, int, int], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r.system, r.size, r.batch), []).append(r)
    out = []
    for (system, size, batch), rs in groups.items():
        figures = {
            f: statistics.median([getattr(r, f) for r in rs])
            for f in (
                "put_gbps",
                "put_p50_us",
                "put_p99_us",
                "get_gbps",
                "get_p50_us",
                "get_p99_us",
            )
        }
        out.append(
            Row(
                system,
                size,
                sum(r.iterations for r in rs),
                rs[0].mode,
                batch,
                **figures,
                rounds=len(rs),
            )
        )
    return out


def median_dicts(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """``{name: {figure: value}}`` per round -> the median of each figure across rounds."""
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        got = [r[name] for r in rounds if name in r]
        out[name] = {f: statistics.median([g[f] for g in got]) for f in got[0]}
    return out
