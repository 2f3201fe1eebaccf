"""History before the measured window of a trace replay (``--history-rows N``).

The trace's first N rows are replayed, unmeasured, before the measured window (the next
``--max-rows`` rows, or the rest), with the same prompt construction as the measured rows
(:func:`pdserve.bench.serve.workloads.trace_prompt`: equal hash ids, equal tokens), against
every system of the run alike, so that its caches (the engines' own, pdserve's pool and its
disk tier) hold what production would have held when the window starts.

The history must reach the system whole: every row is sent, at most
``--history-concurrency`` at a time (as fast as the system takes them, or paced at
``--history-rate``), and a request answered 429, 502, 503 or 504, cut off (a connection
reset, a stream that ends early or carries an error) or timed out is sent again after a
backoff (0.5 s doubling to 10 s, or the answer's Retry-After), up to ``--history-attempts``
times. The run reports how many history requests were served and failed, and what was retried.

Imports only the standard library until it runs (the command line is built from it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.bench.serve.client import completion_payload, sse_data
from pdserve.bench.serve.status import BenchError, say

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve.workloads import PrefixReuse, Request, TraceRow

#: HTTP statuses a history request is retried on (overload, a gateway's hiccup).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: First backoff and its cap, in seconds; Retry-After is honoured up to RETRY_AFTER_MAX_S.
BACKOFF_S = 0.5
BACKOFF_MAX_S = 10.0
RETRY_AFTER_MAX_S = 30.0
#: Errors listed in the outcome (the first ones).
MAX_ERRORS_KEPT = 5


def _history_rate(text: str) -> str:
    """``R`` (requests/s) or ``Kx`` (K times the trace's own rate)."""
    value = text[:-1] if text.endswith("x") else text
    try:
        ok = float(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive rate R or multiple Kx")
    return text


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``--history-rows`` and its replay."""
    d = "(default: %(default)s)"
    g = parser.add_argument_group(
        "history (trace)",
        "replay the trace's first rows, unmeasured, before the measured window, on every "
        "system alike, so its caches hold what production would have held",
    )
    g.add_argument(
        "--history-rows",
        type=int,
        default=0,
        metavar="N",
        help="the trace's first N rows are history; the measured window is the next "
        "--max-rows rows (or the rest). The report gives the window's ideal prefix reuse "
        f"given its history and without, beside each system's achieved reuse {d}",
    )
    g.add_argument(
        "--history-rate",
        type=_history_rate,
        metavar="R|Kx",
        help="send history requests at R per second, evenly spaced, or at K times the "
        "trace's own rate (its arrival times divided by K), in either case never more than "
        "--history-concurrency at once (default: as fast as the system takes them within "
        "--history-concurrency)",
    )
    g.add_argument(
        "--history-concurrency",
        type=int,
        default=8,
        metavar="N",
        help=f"most history requests in flight {d}",
    )
    g.add_argument(
        "--history-attempts",
        type=int,
        default=20,
        metavar="N",
        help="tries per history request before it counts as failed: 429/502/503/504, a "
        "connection reset, a broken stream or a timeout is retried after a backoff (0.5 s "
        f"doubling to 10 s, or Retry-After) {d}",
    )
    g.add_argument(
        "--skip-history",
        action="store_true",
        help="with --history-rows N: measure the same window (the rows after the first N) "
        "but send no history, caches cold: the comparison without history; achieved reuse "
        "is then set beside the ideal without history",
    )


def check_history_args(args: argparse.Namespace) -> None:
    """Raises ValueError for history flags that cannot work together."""
    n = getattr(args, "history_rows", 0) or 0
    if n < 0:
        raise ValueError(f"--history-rows must be >= 0, got {n}")
    if not n:
        if getattr(args, "skip_history", False):
            raise ValueError("--skip-history needs --history-rows N (the rows to skip)")
        return
    if args.workload != "trace":
        raise ValueError("--history-rows needs --workload trace")
    if getattr(args, "find_capacity", False):
        raise ValueError("--history-rows does not work with --find-capacity yet")
    if args.history_concurrency < 1 or args.history_attempts < 1:
        raise ValueError("--history-concurrency and --history-attempts must be at least 1")


# --- the plan -------------------------------------------------------------------------------


def trace_rows(args: argparse.Namespace) -> tuple[list[TraceRow], list[TraceRow]]:
    """``(history, window)``: the trace's first ``--history-rows`` rows and the next
    ``--max-rows`` (0: all the rest).

    Raises:
        BenchError: the history leaves no row to measure.
    """
    from pdserve.bench.serve.workloads import read_trace

    n = getattr(args, "history_rows", 0) or 0
    rows = read_trace(args.trace, n + args.max_rows if args.max_rows else 0)
    if n and len(rows) <= n:
        raise BenchError(f"--history-rows {n}: the trace {args.trace} has only {len(rows)} rows")
    return rows[:n], rows[n:]


@dataclass(frozen=True)
class HistoryPlan:
    """A trace run's history (``requests``, possibly none) and the measured window's ideal
    prefix reuse given it (``given``) and without it (``alone``); ``skipped``: the history
    rows are left out, not replayed (``--skip-history``)."""

    rows: int
    window_rows: int
    block: int
    requests: tuple[Request, ...]
    given: PrefixReuse
    alone: PrefixReuse
    skipped: bool = False

    @property
    def ideal(self) -> PrefixReuse:
        """The ideal the systems' achieved reuse is set beside: given the history when it
        is replayed, else without it."""
        return self.alone if self.skipped else self.given


def history_times(rows: Sequence[TraceRow], rate: str | None) -> float | None:
    """The time scale of the history's arrivals: None (all at once: the concurrency bound
    paces them), ``1 / K`` for ``Kx``; for ``R`` see :func:`plan_history`."""
    if rate is None or not rate.endswith("x"):
        return None
    return 1.0 / float(rate[:-1])


def plan_history(args: argparse.Namespace, vocab: int) -> HistoryPlan | None:
    """The history of a trace run and its window's ideal reuse (None for other workloads);
    says the ideal reuse."""
    import dataclasses

    from pdserve.bench.serve import workloads as wl

    if args.workload != "trace" or not args.trace:
        return None
    history, window = trace_rows(args)
    block = args.block_tokens
    rows = [*history, *window]
    given = wl.ideal_prefix_reuse(rows, len(history), block)
    alone = wl.ideal_prefix_reuse(window, 0, block)
    requests: tuple[Request, ...] = ()
    skipped = bool(history) and getattr(args, "skip_history", False)
    if history and not skipped:
        scale = history_times(history, args.history_rate)
        requests = wl.trace_workload(
            history,
            block=block,
            time_scale=scale or 1.0,
            output_scale=args.output_scale,
            min_output=args.min_output,
            max_output=args.max_output,
            seed=args.seed,
            vocab_size=vocab,
        )
        if args.history_rate is None:
            requests = tuple(dataclasses.replace(r, t_s=0.0) for r in requests)
        elif scale is None:
            rate = float(args.history_rate)
            requests = tuple(dataclasses.replace(r, t_s=i / rate) for i, r in enumerate(requests))
    plan = HistoryPlan(len(history), len(window), block, requests, given, alone, skipped)
    say(describe_plan(plan))
    return plan


def describe_plan(plan: HistoryPlan) -> str:
    alone = f"{plan.alone.token_fraction:.1%} of its prompt tokens ({plan.alone.fraction:.1%} of blocks)"
    if not plan.rows:
        return f"measured window of {plan.window_rows} rows: ideal prefix reuse {alone}"
    if plan.skipped:
        return (
            f"history skipped: the measured window is rows {plan.rows + 1}-"
            f"{plan.rows + plan.window_rows}, sent to cold caches; its ideal prefix reuse "
            f"{alone} (given the skipped rows it would be {plan.given.token_fraction:.1%})"
        )
    return (
        f"history: {plan.rows} rows replayed unmeasured before the measured window of "
        f"{plan.window_rows}; the window's ideal prefix reuse {plan.given.token_fraction:.1%} "
        f"of its prompt tokens ({plan.given.fraction:.1%} of blocks) given the history, {alone} "
        "without"
    )


# --- the replay -----------------------------------------------------------------------------


@dataclass
class HistoryOutcome:
    """How a system took its history: requests served and failed, retries by reason, the
    wall time, and the prompt tokens of the served requests with those served from cache
    (None when the system does not report them)."""

    requests: int = 0
    served: int = 0
    failed: int = 0
    retries: int = 0
    retried_for: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        why = ", ".join(f"{k} x{v}" for k, v in sorted(self.retried_for.items()))
        text = (
            f"history {self.served} of {self.requests} served, {self.failed} failed, "
            f"{self.retries} retries{f' ({why})' if why else ''}, in {self.wall_s:.1f}s"
        )
        if self.cached_tokens is not None and self.prompt_tokens:
            text += (
                f"; {self.cached_tokens / self.prompt_tokens:.1%} of its prompt tokens from cache"
            )
        return text


@dataclass(frozen=True)
class _Attempt:
    """One try: ``usage`` when served; else ``retry`` (a reason) or ``error`` (final)."""

    usage: dict[str, Any] | None = None
    retry: str | None = None
    retry_after_s: float | None = None
    error: str | None = None


def _retry_after(value: str | None) -> float | None:
    try:
        return min(RETRY_AFTER_MAX_S, max(0.0, float(value))) if value else None
    except ValueError:
        return None


async def _attempt(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> _Attempt:
    import aiohttp

    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                if resp.status in RETRY_STATUSES:
                    wait = _retry_after(resp.headers.get("Retry-After"))
                    return _Attempt(retry=f"HTTP {resp.status}", retry_after_s=wait)
                return _Attempt(error=f"HTTP {resp.status}: {text}")
            usage: dict[str, Any] | None = None
            async for data in sse_data(resp):
                if data == b"[DONE]":
                    return _Attempt(usage=usage or {})
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    return _Attempt(retry="error in stream")
                if isinstance(event, dict) and event.get("usage"):
                    usage = event["usage"]
            return _Attempt(retry="stream cut short")
    except (aiohttp.ClientError, ValueError) as exc:  # resets, disconnects, bad JSON
        return _Attempt(retry=type(exc).__name__)
    except TimeoutError:
        return _Attempt(retry="timeout")


async def replay(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    requests: Sequence[Request],
    *,
    concurrency: int = 8,
    attempts: int = 20,
    backoff_s: float = BACKOFF_S,
    backoff_max_s: float = BACKOFF_MAX_S,
    bar: tqdm | None = None,
) -> HistoryOutcome:
    """Sends ``requests`` in order, each no earlier than its ``t_s`` after the start and at
    most ``concurrency`` at a time, retrying each up to ``attempts`` tries (see the module
    docstring); never raises for what a request meets."""
    url = f"{base.rstrip('/')}/v1/completions"
    out = HistoryOutcome(requests=len(requests))
    reasons: Counter[str] = Counter()
    cached: list[int] = []
    t0 = time.perf_counter()
    next_index = 0

    async def one(req: Request) -> None:
        body = completion_payload(model, req)
        for attempt in range(attempts):
            got = await _attempt(session, url, body)
            if got.usage is not None:
                out.served += 1
                out.prompt_tokens += int(got.usage.get("prompt_tokens") or 0)
                details = got.usage.get("prompt_tokens_details") or {}
                if isinstance(details.get("cached_tokens"), int):
                    cached.append(details["cached_tokens"])
                return
            if got.error is not None or attempt == attempts - 1:
                out.failed += 1
                if len(out.errors) < MAX_ERRORS_KEPT:
                    out.errors.append(got.error or f"{got.retry} after {attempts} tries")
                return
            reasons[str(got.retry)] += 1
            out.retries += 1
            wait = min(backoff_max_s, backoff_s * 2**attempt)
            if got.retry_after_s is not None:
                wait = max(wait, got.retry_after_s)
            await asyncio.sleep(wait * (1.0 + 0.1 * random.random()))

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(requests):
            req = requests[next_index]
            next_index += 1
            delay = t0 + req.t_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await one(req)
            if bar is not None:
                bar.update(1)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(requests))))))
    out.wall_s = time.perf_counter() - t0
    out.retried_for = dict(reasons)
    out.cached_tokens = sum(cached) if cached else None
    return out


def replay_history(
    name: str, base: str, key: str, plan: HistoryPlan, args: argparse.Namespace
) -> HistoryOutcome:
    """Replays ``plan``'s history against ``base`` (API key ``key``) with a progress bar;
    says how it went."""
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve.http import auth_headers

    async def main() -> HistoryOutcome:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        connector = aiohttp.TCPConnector(limit=args.history_concurrency)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=auth_headers(key)
        ) as session:
            with tqdm(
                total=len(plan.requests), desc=f"{name} history", disable=args.disable_tqdm
            ) as bar:
                return await replay(
                    session,
                    base,
                    args.model,
                    plan.requests,
                    concurrency=args.history_concurrency,
                    attempts=args.history_attempts,
                    bar=bar,
                )

    out = asyncio.run(main())
    say(f"{name}: {out.summary()}")
    for error in out.errors:
        say(f"  history request failed: {error}")
    return out
