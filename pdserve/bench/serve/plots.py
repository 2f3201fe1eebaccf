"""PNG figures of ``pdserve bench serve`` (matplotlib, Agg backend, imported on first use).

Each function takes ``{system name: records}`` and draws one line per system, so a comparison
run shows both systems on one plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pdserve.bench.serve.metrics import (
    RequestRecord,
    completions_per_window,
    duration_s,
    inflight_steps,
)

Runs = Mapping[str, Sequence[RequestRecord]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure():
    """A new figure and its axes, in the size every plot here uses."""
    return _pyplot().subplots(figsize=(7, 4.5))


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, grid and legend, then writes ``path`` and frees the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _cdf(path: Path, runs: Runs, metric: str, title: str) -> None:
    fig, ax = _figure()
    for name, records in runs.items():
        values = [getattr(r, metric) for r in records if r.success]
        ms = np.sort([v * 1000.0 for v in values if v is not None])
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=name)
    _save(fig, ax, path, f"{title} (ms)", "fraction of requests", f"{title} CDF")


def _throughput(path: Path, runs: Runs, window_s: float) -> None:
    fig, ax = _figure()
    for name, records in runs.items():
        points = completions_per_window(records, window_s)
        if points:
            edges = [x for x, _ in points] + [duration_s(records)]
            ax.stairs([y for _, y in points], edges, label=name, baseline=None)
    ylabel = f"completed requests/s ({window_s:g} s windows)"
    _save(fig, ax, path, "time since first request (s)", ylabel, "Throughput over time")


def _inflight(path: Path, runs: Runs) -> None:
    fig, ax = _figure()
    for name, records in runs.items():
        steps = inflight_steps(records)
        if steps:
            xs, ys = zip(*steps, strict=True)
            ax.step(xs, ys, where="post", label=name)
    ylabel = "requests in flight (sent, not finished)"
    _save(fig, ax, path, "time since first request (s)", ylabel, "In-flight requests over time")


def write_plots(out_dir: str | Path, runs: Runs, window_s: float = 5.0) -> list[Path]:
    """Writes ``ttft_cdf.png``, ``tpot_cdf.png``, ``throughput.png`` and ``inflight.png``
    into ``out_dir`` (created) and returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png", "inflight.png")]
    _cdf(paths[0], runs, "ttft_s", "TTFT")
    _cdf(paths[1], runs, "tpot_s", "TPOT")
    _throughput(paths[2], runs, window_s)
    _inflight(paths[3], runs)
    return paths


def write_capacity_plot(
    out_dir: str | Path,
    series: Mapping[str, Sequence[tuple[float, float, float]]],
    target: float,
    xlabel: str = "rate (req/s)",
) -> Path:
    """Writes ``capacity.png`` into ``out_dir`` (created): per system, attainment against rate
    (``series``: name -> (rate, attainment, bound) per run), its offline bound dashed in the
    same colour, and the target as a dotted line; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "capacity.png"
    fig, ax = _figure()
    for name, points in series.items():
        pts = sorted(points)
        if not pts:
            continue
        rates = [p[0] for p in pts]
        (line,) = ax.plot(rates, [p[1] for p in pts], marker="o", label=f"{name}")
        ax.plot(
            rates,
            [p[2] for p in pts],
            linestyle="--",
            color=line.get_color(),
            label=f"{name} offline bound (TTFT)",
        )
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.set_ylim(0, 1.02)
    _save(fig, ax, path, xlabel, "share of requests meeting every SLO", "Capacity at SLO")
    return path
