"""What a run prints and writes: one system's result (:class:`SystemResult`), vllm bench
serve's table, the side-by-side comparison and the JSON document."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.bench.serve.cpu import CpuReport
    from pdserve.bench.serve.history import HistoryOutcome
    from pdserve.bench.serve.metrics import RequestRecord, RouterFigures, ServeMetrics
    from pdserve.bench.serve.workloads import Request


@dataclass(frozen=True)
class SystemResult:
    """One system's run: its metrics, router figures (pdserve only), records and how it
    took the history replayed before it (``--history-rows``), and where its CPU went during
    the measured window (the processes the run started; None for a ``--target``)."""

    name: str
    url: str
    metrics: ServeMetrics
    router: RouterFigures | None
    records: tuple[RequestRecord, ...]
    history: HistoryOutcome | None = None
    cpu: CpuReport | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "metrics": self.metrics.to_json(),
            "router": self.router.to_json() if self.router else None,
            "history": self.history.to_json() if self.history else None,
            "cpu": self.cpu.to_json() if self.cpu else None,
            "records": [r.to_json() for r in self.records],
        }


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<48}{value}"


def format_result(res: SystemResult) -> str:
    """vllm bench serve's result table, plus the prefix-cache and router figures."""
    m = res.metrics
    out = [f"{' Serving Benchmark Result: ' + res.name + ' ':=^58}"]
    out += [
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Benchmark duration (s):", m.duration_s),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in m.slos_ms.items())
        out.append(_line("Request goodput (req/s):", m.goodput))
        out.append(_line("  SLOs met by:", f"{m.good_requests} requests ({slos})"))
    out += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for title, short, dist in (
        ("Time to First Token", "TTFT", m.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
        ("Inter-token Latency", "ITL", m.itl_ms),
        ("End-to-end Latency", "E2EL", m.e2el_ms),
    ):
        out.append(f"{title:-^58}")
        for stat in ("mean", "median", "p90", "p99", "std"):
            out.append(_line(f"{stat.capitalize()} {short} (ms):", float(getattr(dist, stat))))
    out.append(f"{'Prefix cache':-^58}")
    cached = "n/a (not reported)" if m.cached_tokens is None else m.cached_tokens
    out.append(_line("Prompt tokens served from cache (usage):", cached))
    if m.cached_tokens is not None and m.total_input_tokens:
        out.append(_line("  share of prompt tokens:", m.cached_tokens / m.total_input_tokens))
    if res.router is not None:
        out.append(f"{'pdserve router (/metrics deltas)':-^58}")
        for source, n in res.router.prompt_tokens.items():
            out.append(_line(f"Prompt tokens, source={source}:", int(n)))
        for phase, mean in res.router.phase_mean_s.items():
            count = int(res.router.phase_count[phase])
            out.append(_line(f"Mean {phase} time (ms, n={count}):", mean * 1000.0))
    if res.cpu is not None:
        from pdserve.bench.serve.cpu import format_cpu

        out.append(f"{'CPU in the window (/proc, by role)':-^58}")
        out.extend(format_cpu(res.cpu))
    out.append("=" * 58)
    return "\n".join(out)


#: (label, getter, higher is better) rows of the comparison.
_COMPARE_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("goodput (req/s)", "goodput", True),
    ("request throughput (req/s)", "request_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    ("TTFT p50 (ms)", "ttft_ms.median", False),
    ("TTFT p99 (ms)", "ttft_ms.p99", False),
    ("TPOT p50 (ms)", "tpot_ms.median", False),
    ("TPOT p99 (ms)", "tpot_ms.p99", False),
    ("E2EL p50 (ms)", "e2el_ms.median", False),
)


def _get(m: ServeMetrics, path: str) -> float | None:
    value: Any = m
    for part in path.split("."):
        value = getattr(value, part)
    return None if value is None else float(value)


def comparison(a: SystemResult, b: SystemResult) -> list[dict[str, Any]]:
    """Rows ``{metric, a, b, ratio}`` with ratio = a / b (None when undefined)."""
    rows = []
    for label, path, higher in _COMPARE_ROWS:
        va, vb = _get(a.metrics, path), _get(b.metrics, path)
        if va is None or vb is None:
            continue
        ratio = va / vb if vb else None
        rows.append(
            {"metric": label, a.name: va, b.name: vb, "ratio": ratio, "higher_is_better": higher}
        )
    return rows


def format_comparison(a: SystemResult, b: SystemResult) -> str:
    head = f"{a.name} vs {b.name}: ratio = {a.name} / {b.name}"
    out = [f"{' ' + head + ' ':=^74}"]
    w = max(12, len(a.name) + 2, len(b.name) + 2)  # "colocated-router" and its gap
    out.append(f"{'metric':<30}{a.name:>{w}}{b.name:>{w}}{'ratio':>9}  better")
    for row in comparison(a, b):
        ratio = row["ratio"]
        better = "higher" if row["higher_is_better"] else "lower"
        rtext = "n/a" if ratio is None else f"{ratio:.2f}x"
        out.append(
            f"{row['metric']:<30}{row[a.name]:>{w}.2f}{row[b.name]:>{w}.2f}{rtext:>9}  {better}"
        )
    ca, cb = a.metrics.cached_tokens, b.metrics.cached_tokens
    out.append(f"{'prompt tokens from cache':<30}{_opt(ca):>{w}}{_opt(cb):>{w}}")
    out.append("=" * 74)
    return "\n".join(out)


def better_baseline(baselines: Sequence[SystemResult]) -> SystemResult:
    """The baseline with the highest goodput (request throughput where no SLO is set)."""

    def score(r: SystemResult) -> float:
        m = r.metrics
        return float(m.goodput if m.goodput is not None else m.request_throughput)

    return max(baselines, key=score)


def format_better_baseline(a: SystemResult, baselines: Sequence[SystemResult]) -> str:
    """One line: ``a`` against the better of several baselines."""
    best = better_baseline(baselines)
    rows = {row["metric"]: row for row in comparison(a, best)}
    row = rows.get("goodput (req/s)") or rows["request throughput (req/s)"]
    ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
    return f"{a.name} vs the better baseline ({best.name}): {row['metric']} {ratio}"


def _opt(v: int | None) -> str:
    return "n/a" if v is None else str(v)


def write_json(
    path: str,
    args: argparse.Namespace,
    requests: Sequence[Request],
    results: list[SystemResult],
    extra: dict[str, Any] | None = None,
) -> None:
    """The run's JSON: config, workload, systems, comparison and ``extra``'s sections."""
    from dataclasses import asdict

    from pdserve.bench.serve.workloads import workload_stats

    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = str(args.request_rate)
    doc: dict[str, Any] = {
        "config": config,
        "workload": asdict(workload_stats(requests)),
        "systems": [r.to_json() for r in results],
    }
    if len(results) >= 2:  # with several baselines: against the better, and against each
        best = better_baseline(results[1:])
        doc["comparison"] = comparison(results[0], best)
        if len(results) > 2:
            doc["better_baseline"] = best.name
            doc["comparisons"] = {b.name: comparison(results[0], b) for b in results[1:]}
    doc.update(extra or {})
    Path(path).write_text(json.dumps(doc, indent=1))
