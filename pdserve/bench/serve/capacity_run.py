"""The runs of ``pdserve bench serve --find-capacity`` (:mod:`pdserve.bench.serve.capacity`):
the workload at a rate, the prefill-throughput calibration, one measured run, and each
system started once for its whole search.

Rates: a trace at rate R replays at multiplier m = R / its own rate (requests / span of
arrivals at ``--time-scale``), its arrivals divided by m (``--time-scale`` / m); random,
prefix-repetition and multi-round workloads are regenerated with ``--request-rate`` R (the
same seed: the same lengths and prefix sharing). Each run after a system's first shifts every
token id by the run's number (modulo the vocabulary above the special ids), so no run finds an
earlier run's prompts in the system's prefix cache while the workload keeps its own sharing.

Prefill throughput ``P`` (for the bound): ``--prefill-tokens-per-s``, else measured per system
before its search: ``--calibrate-requests`` random prompts of the workload's mean input length,
sent at once with ``max_tokens`` 1; ``P`` = their computed prompt tokens (prompt tokens less
reported cached ones) / (first send to last response). That is the system's saturated prefill
rate, each system's own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.serve.capacity import (
    Point,
    Search,
    SystemCapacity,
    capacity_doc,
    check_args,
    format_table,
    progress_line,
    rate_text,
    search_capacity,
)
from pdserve.bench.serve.offline_max import OfflineMax, any_rate_max
from pdserve.bench.serve.status import BenchError, say
from pdserve.bench.serve.workloads import TOKEN_LOW, Request


@dataclass(frozen=True)
class RatePlan:
    """How to make the workload at a rate: ``unit``, ``start`` and, for a trace, ``base_rate``
    (req/s at multiplier 1; None otherwise)."""

    requests: tuple[Request, ...]
    unit: str
    start: float
    base_rate: float | None
    regenerate: Callable[[float], tuple[Request, ...]] | None = None

    def multiplier(self, rate: float) -> float | None:
        return rate / self.base_rate if self.base_rate else None

    def at(self, rate: float) -> tuple[Request, ...]:
        if self.base_rate:
            m = rate / self.base_rate
            return tuple(
                Request(r.t_s / m, r.prompt_token_ids, r.max_tokens) for r in self.requests
            )
        assert self.regenerate is not None
        return self.regenerate(rate)


def rate_plan(
    args: argparse.Namespace,
    requests: tuple[Request, ...],
    build: Callable[[argparse.Namespace], tuple[Request, ...]],
) -> RatePlan:
    """The rates of ``args``' workload (``requests`` built from them; ``build`` builds it at
    another ``--request-rate``)."""
    if args.workload == "trace":
        if any(r.after is not None for r in requests):
            raise BenchError("a trace with dependent requests cannot be time-scaled")
        span = max(r.t_s for r in requests)
        if span <= 0:
            raise BenchError("--find-capacity needs a trace whose arrivals span some time")
        base = len(requests) / span
        return RatePlan(requests, "req/s", args.rate_start or base, base)
    unit = "conv/s" if args.workload == "multi-round" else "req/s"
    start = args.rate_start or (args.request_rate if math.isfinite(args.request_rate) else 1.0)

    def regenerate(rate: float) -> tuple[Request, ...]:
        return build(argparse.Namespace(**{**vars(args), "request_rate": rate}))

    return RatePlan(requests, unit, start, None, regenerate)


def shift_tokens(requests: Sequence[Request], shift: int, vocab: int) -> tuple[Request, ...]:
    """Every token id t >= TOKEN_LOW moved to TOKEN_LOW + (t - TOKEN_LOW + shift) mod
    (vocab - TOKEN_LOW): a bijection, so prefix sharing within the workload stays."""
    if shift == 0:
        return tuple(requests)
    span = vocab - TOKEN_LOW

    def move(t: int) -> int:
        return TOKEN_LOW + (t - TOKEN_LOW + shift) % span if t >= TOKEN_LOW else t

    return tuple(
        Request(r.t_s, tuple(move(t) for t in r.prompt_token_ids), r.max_tokens, r.after)
        for r in requests
    )


def releases(requests: Sequence[Request], sent: Mapping[int, float]) -> list[float]:
    """Arrival of each request for the bound: its ``t_s`` when open loop, else its measured
    send time (``sent``, by index; its parent's release + ``t_s`` when it has none)."""
    out: list[float] = []
    for i, r in enumerate(requests):
        if r.after is None:
            out.append(r.t_s)
        else:
            out.append(sent.get(i, out[r.after] + r.t_s))
    return out


@dataclass
class SystemUnderTest:
    """A running system: warm-up with its first request batch only, a run counter."""

    name: str
    base: str
    key: str
    args: argparse.Namespace
    vocab: int
    runs: int = 0
    warmed: bool = field(default=False)

    def send(self, requests: Sequence[Request], label: str) -> list:
        from pdserve.bench.serve.client import send_workload

        warmup = 0 if self.warmed else self.args.warmup
        self.warmed = True
        return asyncio.run(
            send_workload(
                self.base,
                self.args.model,
                requests,
                self.args,
                label,
                lambda: None,
                self.vocab,
                self.key,
                warmup=warmup,
            )
        )

    def calibrate(self, mean_input: float) -> float:
        """Saturated prefill throughput in prompt tokens/s (see the module docstring)."""
        import numpy as np

        rng = np.random.default_rng([self.args.seed, 7331])
        n = max(1, round(mean_input))
        burst = [
            Request(0.0, tuple(int(t) for t in rng.integers(TOKEN_LOW, self.vocab, n)), 1)
            for _ in range(self.args.calibrate_requests)
        ]
        done = [r for r in self.send(burst, f"{self.name} calibration") if r.success]
        if not done:
            raise BenchError(f"{self.name}: every calibration request failed")
        wall = max(r.end_s for r in done) - min(r.send_s for r in done)
        tokens = sum(r.prompt_tokens - (r.cached_tokens or 0) for r in done)
        if wall <= 0 or tokens <= 0:
            raise BenchError(f"{self.name}: calibration measured no prefill time")
        say(
            f"{self.name}: prefill throughput {tokens / wall:.0f} prompt tokens/s ({len(done)} "
            f"prompts of {n} tokens at once in {wall:.2f}s)"
        )
        return tokens / wall

    def measure(
        self, plan: RatePlan, rate: float, slos: Mapping[str, float], prefill: float
    ) -> Point:
        """One run of the workload at ``rate`` and its numbers."""
        from pdserve.bench.serve.metrics import compute_metrics, is_good
        from pdserve.bench.serve.offline_max import offline_max

        requests = plan.at(rate)
        records = self.send(
            shift_tokens(requests, self.runs, self.vocab), f"{self.name} @ {rate_text(rate)}"
        )
        self.runs += 1
        m = compute_metrics(records, slos)
        good = sum(1 for r in records if is_good(r, slos))
        bound = offline_max(
            requests,
            prefill,
            slos["ttft"] / 1000.0,
            self.args.bound_block,
            releases(requests, {r.index: r.send_s for r in records}),
        )
        total = len(requests)
        attainment = good / total if total else 0.0
        return Point(
            system=self.name,
            rate=rate,
            multiplier=plan.multiplier(rate),
            attainment=attainment,
            good=good,
            total=total,
            completed=m.completed,
            ttft_p50_ms=m.ttft_ms.median,
            ttft_p99_ms=m.ttft_ms.p99,
            tpot_p50_ms=m.tpot_ms.median,
            tpot_p99_ms=m.tpot_ms.p99,
            goodput=m.goodput or 0.0,
            bound=bound.fraction,
            bound_on_time=bound.on_time,
            computed_tokens=bound.computed_tokens,
            duration_s=m.duration_s,
            passed=attainment >= self.args.attainment,
        )


def search_system(
    sut: SystemUnderTest, plan: RatePlan, slos: Mapping[str, float], mean_input: float
) -> SystemCapacity:
    """Calibrates (unless ``--prefill-tokens-per-s``) and searches one running system."""
    from pdserve.bench.serve.http import check_target

    args = sut.args
    check_target(sut.base, args.model, sut.key)
    if args.prefill_tokens_per_s:
        prefill, source = args.prefill_tokens_per_s, "flag"
    else:
        prefill, source = sut.calibrate(mean_input), "calibrated"
    ceiling = any_rate_bound(plan, prefill, slos, args.bound_block)
    if ceiling is not None and ceiling.fraction < args.attainment:
        say(
            f"{sut.name}: no rate can reach {args.attainment:.0%} on time: at {prefill:.0f} "
            f"prompt tokens/s at most {ceiling.on_time} of {ceiling.total} "
            f"({ceiling.fraction:.1%}) first tokens can be on time at any rate (requests that "
            f"arrive together share one {slos['ttft'] / 1000:g} s window, whatever the rate); "
            "its search is skipped. To compare under that bound, lower --attainment"
        )
        return SystemCapacity(sut.name, Search(), prefill, source, plan.base_rate, ceiling=ceiling)
    search = search_capacity(
        lambda rate: sut.measure(plan, rate, slos, prefill),
        plan.start,
        args.attainment,
        args.capacity_steps,
        args.rate_tolerance,
        on_point=lambda _rate, p, _ok: say(progress_line(p, plan.unit)),
    )
    return SystemCapacity(sut.name, search, prefill, source, plan.base_rate, ceiling=ceiling)


def any_rate_bound(
    plan: RatePlan, prefill: float, slos: Mapping[str, float], block: int
) -> OfflineMax | None:
    """The most of ``plan``'s requests on time at any rate (None when some are sent after
    another finished: their arrivals depend on the run)."""
    if any(r.after is not None for r in plan.requests):
        return None
    return any_rate_max(plan.requests, prefill, slos["ttft"] / 1000.0, block)


def at_rate(
    sut: SystemUnderTest,
    cap: SystemCapacity,
    rate: float,
    plan: RatePlan,
    slos: Mapping[str, float],
) -> Point:
    """``sut`` at ``rate`` (the baseline's capacity): the run its search ``cap`` made at that
    rate, else one more run (printed, not part of the search)."""
    for tried, point in cap.search.tried:
        if math.isclose(tried, rate, rel_tol=1e-9):
            return point
    point = sut.measure(plan, rate, slos, cap.prefill_tokens_per_s)
    say(progress_line(point, plan.unit) + " (the baseline's capacity)")
    return point


def run_capacity(args: argparse.Namespace) -> list[SystemCapacity]:
    """Starts each system once (the baseline first), searches it, runs the system under test
    at the baseline's capacity, prints the table and writes JSON and plot."""
    from pdserve.bench.serve.run import build_workload, each_system, result_path, vocab_size
    from pdserve.bench.serve.workloads import workload_stats

    slos = check_args(args)
    requests = build_workload(args)
    if not requests:
        raise BenchError("the workload has no requests")
    plan = rate_plan(args, requests, build_workload)
    st = workload_stats(requests)
    base = f" (its own rate {plan.base_rate:.2f} req/s)" if plan.base_rate else ""
    say(
        f"capacity search, workload {args.workload}{base}: {st.requests} requests, mean input "
        f"{st.mean_input:.1f} tokens; from {rate_text(plan.start)} {plan.unit}, at most "
        f"{args.capacity_steps} runs per system, target {args.attainment:.0%} on time"
    )
    vocab = vocab_size(args)
    # The baseline first: then the system under test also runs at the baseline's capacity.
    found: dict[bool, SystemCapacity] = {}
    with each_system(args, baseline_first=True) as each:
        for system in each:
            sut = SystemUnderTest(system.name, system.url, system.key, args, vocab)
            cap = search_system(sut, plan, slos, st.mean_input)
            baseline = found.get(False)
            if system.is_target and baseline is not None and baseline.search.capacity > 0:
                point = at_rate(sut, cap, baseline.search.capacity, plan, slos)
                cap = dataclasses.replace(cap, at_baseline=point)
            found[system.is_target] = cap
    systems = [found[k] for k in (True, False) if k in found]  # the system under test first
    print(format_table(systems, plan.unit, args.attainment, slos), flush=True)
    path = result_path(args)
    if path:
        import json

        Path(path).write_text(json.dumps(capacity_doc(systems, args, plan.unit), indent=1))
        say(f"wrote {path}")
    if args.plot_dir:
        from pdserve.bench.serve.plots import write_capacity_plot

        series = {c.name: [(p.rate, p.attainment, p.bound) for p in c.points] for c in systems}
        out = write_capacity_plot(args.plot_dir, series, args.attainment, f"rate ({plan.unit})")
        say(f"wrote {out}")
    return systems
