"""``pdserve bench serve --find-capacity``: the highest request rate at which a system still
meets its SLOs for a given share of requests (DistServe's goodput; the runs:
:mod:`pdserve.bench.serve.capacity_run`).

Attainment at a rate is the share of ALL requests that meet every ``--goodput`` SLO (failed
requests count as missed; vLLM's goodput counts completed ones only). The search
(:func:`search_capacity`) runs at ``--rate-start``, doubles the rate while attainment reaches
``--attainment`` (or halves it until it does), then bisects geometrically until the bracket's
ratio is within ``1 + --rate-tolerance`` or ``--capacity-steps`` runs are spent. The capacity
is the highest rate that passed (0 when none did). Beside each run stands the exact offline
maximum share for TTFT (:mod:`pdserve.bench.serve.offline_max`) at that system's prefill
throughput. This module holds the pure parts: flags check, search, table, JSON.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from pdserve.bench.serve.offline_max import OfflineMax


class _Attained(Protocol):
    @property
    def attainment(self) -> float: ...


T = TypeVar("T", bound=_Attained)


@dataclass(frozen=True)
class Point:
    """One run of one system at one rate (latencies in ms; ``multiplier`` for traces only;
    ``bound`` the offline maximum share of on-time TTFTs)."""

    system: str
    rate: float
    multiplier: float | None
    attainment: float
    good: int
    total: int
    completed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    goodput: float
    bound: float
    bound_on_time: int
    computed_tokens: int
    duration_s: float
    passed: bool = False


@dataclass
class Search:
    """A search's outcome: ``lo`` the highest rate that passed (None: none did), ``hi`` the
    lowest that failed (None: none did, so the capacity is at least ``lo``), ``tried`` every
    rate in order with its result."""

    lo: float | None = None
    hi: float | None = None
    tried: list[tuple[float, Any]] = field(default_factory=list)

    @property
    def capacity(self) -> float:
        return self.lo if self.lo is not None else 0.0

    @property
    def at_least(self) -> bool:
        """No rate failed: the capacity is only a lower bound."""
        return self.lo is not None and self.hi is None


def search_capacity(
    measure: Callable[[float], T],
    start: float,
    target: float,
    max_steps: int = 6,
    tolerance: float = 0.1,
    on_point: Callable[[float, T, bool], None] | None = None,
) -> Search:
    """Calls ``measure(rate)`` at most ``max_steps`` times: first at ``start``; while its
    ``attainment`` >= ``target``, at twice the rate until one fails (else at half until one
    passes); then at sqrt(lo * hi) until hi / lo <= 1 + ``tolerance``. Every rate that passed
    is below every rate that failed. ``on_point(rate, result, passed)`` after each run."""
    if start <= 0 or max_steps < 1 or tolerance <= 0:
        raise ValueError("need start > 0, max_steps >= 1 and tolerance > 0")
    s = Search()

    def run(rate: float) -> bool:
        result = measure(rate)
        ok = result.attainment >= target
        s.tried.append((rate, result))
        if ok:
            s.lo = rate
        else:
            s.hi = rate
        if on_point is not None:
            on_point(rate, result, ok)
        return ok

    passed = run(start)
    rate = start
    while len(s.tried) < max_steps and (s.hi if passed else s.lo) is None:
        rate = rate * 2 if passed else rate / 2
        run(rate)
    while (
        len(s.tried) < max_steps
        and s.lo is not None
        and s.hi is not None
        and s.hi / s.lo > 1 + tolerance
    ):
        run(math.sqrt(s.lo * s.hi))
    return s


def check_args(args: argparse.Namespace) -> dict[str, float]:
    """The SLOs of a ``--find-capacity`` run (ms), after checking its flags.

    Raises:
        ValueError: no ``--goodput`` with ttft, a capacity flag out of range, or
            ``--compare both``.
    """
    from pdserve.bench.serve.metrics import parse_goodput

    slos = parse_goodput(args.goodput or [])
    if "ttft" not in slos:
        raise ValueError(
            "--find-capacity needs SLOs with a TTFT one: --goodput ttft:MS [tpot:MS] [e2el:MS]"
        )
    if getattr(args, "compare", "none") == "both":
        raise ValueError(
            "--find-capacity searches one baseline: --compare colocated or colocated-router"
        )
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.capacity_steps < 1:
        raise ValueError("--capacity-steps must be at least 1")
    if args.rate_tolerance <= 0:
        raise ValueError("--rate-tolerance must be positive")
    if args.calibrate_requests < 1:
        raise ValueError("--calibrate-requests must be at least 1")
    if args.bound_block < 1:
        raise ValueError("--bound-block must be at least 1")
    if args.rate_start is not None and not math.isfinite(args.rate_start):
        raise ValueError("--rate-start must be finite")
    return slos


# --- output ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SystemCapacity:
    """One system's search: its capacity, prefill throughput (and where it came from) and
    runs."""

    name: str
    search: Search
    prefill_tokens_per_s: float
    prefill_source: str  # "flag" or "calibrated"
    base_rate: float | None  # req/s of a trace at multiplier 1
    #: The system under test at the baseline's capacity rate (its search's run at that rate,
    #: or one more run; not part of the search); None without a baseline that passed.
    at_baseline: Point | None = None
    #: The most requests on time at any rate (:func:`~pdserve.bench.serve.offline_max.
    #: any_rate_max`) at this system's prefill throughput; None for closed-loop workloads.
    ceiling: OfflineMax | None = None

    @property
    def unreachable(self) -> bool:
        """No rate can reach the target: the search was skipped (nothing tried)."""
        return self.ceiling is not None and not self.search.tried

    @property
    def points(self) -> list[Point]:
        tried = [p for _, p in self.search.tried]
        extra = self.at_baseline is not None and all(p is not self.at_baseline for p in tried)
        return [*tried, self.at_baseline] if extra else tried  # type: ignore[list-item]

    def to_json(self) -> dict[str, Any]:
        s = self.search
        mult = s.capacity / self.base_rate if self.base_rate else None
        out: dict[str, Any] = {
            "rate": s.capacity,
            "multiplier": mult,
            "at_least": s.at_least,
            "none_passed": s.lo is None,
            "bracket": [s.lo, s.hi],
            "runs": len(s.tried),
        }
        if self.ceiling is not None:
            out["any_rate_bound"] = {
                "on_time": self.ceiling.on_time,
                "total": self.ceiling.total,
                "fraction": self.ceiling.fraction,
            }
            out["skipped_unreachable"] = self.unreachable
        if self.at_baseline is not None:
            b = self.at_baseline
            out["at_baseline_capacity"] = {
                "rate": b.rate,
                "attainment": b.attainment,
                "good": b.good,
                "total": b.total,
            }
        return out


def rate_text(rate: float) -> str:
    """A rate with two decimals, or three significant digits where two decimals would round
    it (the halvings of 1 go 0.50, 0.25, 0.125, 0.0625, not 0.12, 0.06)."""
    two = f"{rate:.2f}"
    return two if math.isclose(float(two), rate, rel_tol=1e-9, abs_tol=1e-12) else f"{rate:.3g}"


def progress_line(p: Point, unit: str) -> str:
    """``pdserve: rate 2.00 req/s -> 93.4% on time (bound 98.8%); TTFT p99 1.90 s, TPOT p99
    265 ms``: the run's figures as it ends (a search stopped early keeps them in its log)."""
    mult = f" (x{p.multiplier:.2f})" if p.multiplier is not None else ""
    return (
        f"{p.system}: rate {rate_text(p.rate)} {unit}{mult} -> {p.attainment:.1%} on time "
        f"(bound {p.bound:.1%}); TTFT p99 {p.ttft_p99_ms / 1000:.2f} s, "
        f"TPOT p99 {p.tpot_p99_ms:.0f} ms"
    )


def capacity_text(c: SystemCapacity, unit: str) -> str:
    s = c.search
    if c.unreachable:
        return "none at any rate (the bound at any rate is under the target; not searched)"
    if s.lo is None:
        low = min(rate for rate, _ in s.tried)
        return f"0 (below the lowest rate tried, {rate_text(low)} {unit})"
    mult = f" (x{s.capacity / c.base_rate:.2f})" if c.base_rate else ""
    above = f", below {rate_text(s.hi)}" if s.hi is not None else ", no rate tried failed"
    return f"{'>= ' if s.at_least else ''}{rate_text(s.capacity)} {unit}{mult}{above}"


def ratio(systems: Sequence[SystemCapacity]) -> float | None:
    """First system's capacity / second's (None without two systems or a zero second)."""
    if len(systems) != 2 or systems[1].search.capacity <= 0:
        return None
    return systems[0].search.capacity / systems[1].search.capacity


def format_table(
    systems: Sequence[SystemCapacity], unit: str, target: float, slos: Mapping[str, float]
) -> str:
    """Every run of every system, then the capacities and their ratio."""
    trace = any(c.base_rate for c in systems)
    head = f"{'system':<12}{'rate ' + unit:>14}" + (f"{'x':>7}" if trace else "")
    head += f"{'on time':>9}{'bound':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
    head += f"{'goodput':>9}"
    slo_text = " ".join(f"{k}<={v:g}ms" for k, v in slos.items())
    title = f" Capacity at {target:.0%} attainment ({slo_text}) "
    out = [f"{title:=^{len(head)}}", head]
    for c in systems:
        for p in sorted(c.points, key=lambda p: p.rate):
            row = f"{p.system:<12}{rate_text(p.rate):>14}"
            if trace:
                row += f"{p.multiplier:>7.2f}" if p.multiplier is not None else f"{'':>7}"
            row += f"{p.attainment:>9.1%}{p.bound:>8.1%}{p.ttft_p50_ms:>10.0f}"
            row += f"{p.ttft_p99_ms:>9.0f}{p.tpot_p50_ms:>10.0f}{p.tpot_p99_ms:>8.0f}"
            out.append(row + f"{p.goodput:>9.2f}")
    out.append("-" * len(head))
    for c in systems:
        src = f"{c.prefill_tokens_per_s:.0f} prompt tok/s ({c.prefill_source})"
        line = f"{c.name} capacity: {capacity_text(c, unit)}; bound at {src}"
        if c.ceiling is not None:
            line += f"; at any rate at most {c.ceiling.fraction:.1%} on time"
        out.append(line)
    for c, other in zip(systems, reversed(systems), strict=True):
        if c.at_baseline is not None:
            b = c.at_baseline
            out.append(
                f"{c.name} at {other.name}'s capacity ({rate_text(b.rate)} {unit}): "
                f"{b.attainment:.1%} on time ({b.good} of {b.total})"
            )
    r = ratio(systems)
    if len(systems) == 2:
        names = f"{systems[0].name} / {systems[1].name}"
        out.append(f"ratio {names}: {'n/a' if r is None else f'{r:.2f}x'}")
    out.append("=" * len(head))
    return "\n".join(out)


def capacity_doc(
    systems: Sequence[SystemCapacity], args: argparse.Namespace, unit: str
) -> dict[str, Any]:
    """The ``--json`` document of a capacity search."""
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = str(args.request_rate)
    return {
        "capacity": {c.name: c.to_json() for c in systems},
        "ratio": ratio(systems),
        "unit": unit,
        "target_attainment": args.attainment,
        "points": [asdict(p) for c in systems for p in c.points],
        "prefill_tokens_per_s": {
            c.name: {"value": c.prefill_tokens_per_s, "source": c.prefill_source} for c in systems
        },
        "args": config,
    }
