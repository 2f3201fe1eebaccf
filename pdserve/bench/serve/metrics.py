"""Serving metrics of ``pdserve bench serve``: pure functions over per-request records.

The definitions follow ``vllm bench serve`` (``vllm/benchmarks/serve.py``), so numbers from
the two tools are comparable:

- **TTFT**: first token-carrying chunk minus send time.
- **E2EL**: last chunk minus send time.
- **TPOT** per request: ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more
  than one output token (for goodput a request with one token counts as TPOT 0, as in vLLM).
- **ITL**: the gaps between successive token-carrying chunks; a chunk with several tokens is
  one gap, as in vLLM.
- **duration**: first send to last completion (over every request, failed ones included).
- request / output token / total token throughput: completed requests, output tokens of
  completed requests, and prompt + output tokens of completed requests, each per second of
  duration.
- **goodput**: completed requests that meet every given SLO (metric <= SLO), per second.

Statistics are in milliseconds: mean, median, p90, p99 (numpy's default linear percentile
interpolation, as vLLM) and the population standard deviation (``np.std``). An empty sample
gives zeros, as vLLM's ``np.mean(x or 0)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: SLO names ``--goodput`` accepts, each in milliseconds.
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock.

    ``chunk_s`` holds the arrival time of every SSE chunk that carried generated text, in
    order; ``end_s`` is when the stream ended (last chunk, or the error); ``text`` the
    generated text (two runs of one seeded workload may still differ at temperature 0: how
    requests batch changes bf16 rounding, so a text comparison across runs is no integrity
    check). A request is successful when
    it got a token chunk and no error.
    """

    index: int
    send_s: float
    end_s: float
    chunk_s: tuple[float, ...] = ()
    last_chunk_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""

    @property
    def success(self) -> bool:
        return self.error is None and len(self.chunk_s) > 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.success else None

    @property
    def e2el_s(self) -> float | None:
        if not self.success:
            return None
        last = self.last_chunk_s if self.last_chunk_s is not None else self.chunk_s[-1]
        return last - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """None for failed requests and for requests with at most one output token."""
        ttft, e2el = self.ttft_s, self.e2el_s
        if ttft is None or e2el is None or self.output_tokens <= 1:
            return None
        return (e2el - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        if not self.success:
            return []
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_s"] = list(self.chunk_s)
        d.update(success=self.success, ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2el_s=self.e2el_s)
        return d


@dataclass(frozen=True)
class Dist:
    """Summary of one latency sample, in milliseconds."""

    n: int
    mean: float
    median: float
    p90: float
    p99: float
    std: float


@dataclass(frozen=True)
class ServeMetrics:
    """Everything ``vllm bench serve`` reports, from one list of records."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    good_requests: int | None
    slos_ms: dict[str, float]
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2el_ms: Dist
    cached_tokens: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def dist_ms(values_s: Sequence[float]) -> Dist:
    """Mean, median, p90, p99 and std of ``values_s`` (seconds) in milliseconds."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return Dist(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Dist(
        n=int(arr.size),
        mean=float(np.mean(arr)),
        median=float(np.median(arr)),
        p90=float(np.percentile(arr, 90)),
        p99=float(np.percentile(arr, 99)),
        std=float(np.std(arr)),
    )


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: an unknown name, a missing colon, or a value that is not a positive number.
    """
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput: {item!r} is not NAME:MS with NAME in {SLO_NAMES}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {item!r}: the SLO must be positive")
        slos[name] = ms
    return slos


def duration_s(records: Sequence[RequestRecord]) -> float:
    """First send to last completion over all records (0 when there are none)."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.send_s for r in records)


def is_good(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO (vLLM: metric <= SLO; TPOT of a request
    with one output token counts as 0)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all((values[name] or 0.0) * 1000.0 <= slo for name, slo in slos_ms.items())


def compute_metrics(
    records: Sequence[RequestRecord],
    slos_ms: Mapping[str, float] | None = None,
    duration: float | None = None,
) -> ServeMetrics:
    """The benchmark's numbers from its records; ``duration`` overrides :func:`duration_s`.
    Goodput is None unless SLOs are given."""
    done = [r for r in records if r.success]
    dur = duration_s(records) if duration is None else duration
    per_s = 1.0 / dur if dur > 0 else 0.0
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if is_good(r, slos_ms)) if slos_ms else None
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    return ServeMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=dur,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) * per_s,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        goodput=None if good is None else good * per_s,
        good_requests=good,
        slos_ms=dict(slos_ms or {}),
        ttft_ms=dist_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=dist_ms([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=dist_ms([g for r in done for g in r.itls_s]),
        e2el_ms=dist_ms([r.e2el_s for r in done if r.e2el_s is not None]),
        cached_tokens=sum(cached) if cached else None,
    )


def completions_per_window(
    records: Sequence[RequestRecord], window_s: float = 5.0
) -> list[tuple[float, float]]:
    """``(window start offset s, completed requests/s in that window)`` from the first send;
    a request counts in the window of its ``end_s``; the last window is partial and divided by
    its real length."""
    if not records:
        return []
    t0 = min(r.send_s for r in records)
    total = duration_s(records)
    n = max(1, int(np.ceil(total / window_s)))
    counts = [0] * n
    for r in records:
        if r.success:
            counts[min(n - 1, int((r.end_s - t0) // window_s))] += 1
    out = []
    for i, c in enumerate(counts):
        length = min(window_s, total - i * window_s) if total > 0 else window_s
        out.append((i * window_s, c / length if length > 0 else 0.0))
    return out


def inflight_steps(records: Sequence[RequestRecord]) -> list[tuple[float, int]]:
    """The number of requests sent and not finished, as ``(offset s, count after)`` steps
    from the first send (ends before sends at equal times)."""
    if not records:
        return []
    t0 = min(r.send_s for r in records)
    events = sorted(
        [(r.send_s - t0, 1) for r in records] + [(r.end_s - t0, -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    steps, level = [(0.0, 0)], 0
    for t, d in events:
        level += d
        steps.append((t, level))
    return steps


# --- pdserve router figures from /metrics ---------------------------------------------------

#: A Prometheus sample key: (sample name, sorted label items).
SampleKey = tuple[str, tuple[tuple[str, str], ...]]

PROMPT_TOKENS_SAMPLE = "pdserve_router_prompt_tokens_total"
PHASE_SUM_SAMPLE = "pdserve_router_phase_seconds_sum"
PHASE_COUNT_SAMPLE = "pdserve_router_phase_seconds_count"


@dataclass(frozen=True)
class RouterFigures:
    """Deltas of the router's counters over one run: prompt tokens by source (e.g. store,
    computed, local) and, per phase (e.g. queue, prefill, kv_transfer, decode), the number of
    observations and their mean in seconds. Metrics the router does not export are absent."""

    prompt_tokens: dict[str, float]
    phase_count: dict[str, float]
    phase_mean_s: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_prometheus(text: str) -> dict[SampleKey, float]:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _by_label(samples: Mapping[SampleKey, float], name: str, label: str) -> dict[str, float]:
    return {
        dict(labels).get(label, ""): value for (n, labels), value in samples.items() if n == name
    }


def router_figures(
    before: Mapping[SampleKey, float], after: Mapping[SampleKey, float]
) -> RouterFigures:
    """The router's counters after minus before (a sample missing before counts from 0);
    phases with no new observation are left out."""

    def delta(name: str, label: str) -> dict[str, float]:
        b, a = _by_label(before, name, label), _by_label(after, name, label)
        return {k: v - b.get(k, 0.0) for k, v in sorted(a.items())}

    sums = delta(PHASE_SUM_SAMPLE, "phase")
    counts = {k: v for k, v in delta(PHASE_COUNT_SAMPLE, "phase").items() if v > 0}
    return RouterFigures(
        prompt_tokens=delta(PROMPT_TOKENS_SAMPLE, "source"),
        phase_count=counts,
        phase_mean_s={k: sums.get(k, 0.0) / c for k, c in counts.items()},
    )
