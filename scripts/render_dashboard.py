#!/usr/bin/env python3
"""Render a Grafana dashboard JSON to a PNG by evaluating its PromQL against Prometheus.

No Grafana needed: every panel's targets go to Prometheus' ``/api/v1/query_range`` (Grafana
variables such as ``$__rate_interval``, ``$__interval`` and ``${datasource}`` substituted), and
matplotlib draws a grid of small charts laid out like the panels' ``gridPos`` (rows become
headings; a stat or gauge panel shows its last value big, over a faint line). Prints, per
panel, how many series came back, or "no data".

    .venv/bin/python scripts/render_dashboard.py --prometheus http://127.0.0.1:9099 \\
        --dashboard deploy/grafana/pdserve-dashboard.json --out docs/dashboard.png --minutes 5

Needs only the standard library and matplotlib (a pdserve dependency).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

GRID_COLUMNS = 24
VALUE_PANELS = {"stat", "gauge", "bargauge"}


@dataclass
class Series:
    label: str
    times: list[float]
    values: list[float]


@dataclass
class PanelResult:
    panel: dict
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def substitute(expr: str, step_s: int, rate_interval: str) -> str:
    """``expr`` with the Grafana variables Prometheus does not know replaced."""
    step = f"{step_s}s"
    replacements = {
        "__rate_interval": rate_interval,
        "__interval": step,
        "__range": step,
        "__interval_ms": str(step_s * 1000),
        "__range_s": str(step_s),
    }

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return replacements.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def legend(fmt: str, metric: dict[str, str], expr: str) -> str:
    """Grafana's ``legendFormat`` (``{{label}}``) applied to ``metric``; else its labels."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    labels = {k: v for k, v in metric.items() if k != "__name__"}
    if labels:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return metric.get("__name__") or (expr if len(expr) <= 40 else expr[:37] + "...")


def query_range(base: str, expr: str, start: float, end: float, step_s: int) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    url = f"{base.rstrip('/')}/api/v1/query_range?{params}"
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def evaluate(
    base: str, panel: dict, start: float, end: float, step_s: int, rate_interval: str
) -> PanelResult:
    result = PanelResult(panel)
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        expr = substitute(target["expr"], step_s, rate_interval)
        try:
            data = query_range(base, expr, start, end, step_s)
        except Exception as e:  # a broken query is reported, not fatal
            result.errors.append(f"{target.get('refId', '?')}: {e}")
            continue
        for item in data:
            points = [(float(t), float(v)) for t, v in item.get("values", [])]
            points = [(t, v) for t, v in points if math.isfinite(v)]
            if not points:
                continue
            times, values = zip(*points, strict=True)
            label = legend(target.get("legendFormat", ""), item.get("metric", {}), expr)
            result.series.append(Series(label, list(times), list(values)))
    return result


def flatten(panels: list[dict]) -> list[dict]:
    """Panels in order, those inside collapsed rows included."""
    out = []
    for p in panels:
        out.append(p)
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
    return out


def unit_format(unit: str, v: float) -> str:
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "percent":
        return f"{v:.1f}%"
    if unit in {"bytes", "decbytes"}:
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or suffix == "TiB":
                return f"{v:.1f} {suffix}"
            v /= 1024
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    return f"{v:.3g}"


def render(
    results: list[PanelResult],
    title: str,
    out: Path,
    window: tuple[float, float],
    width: float,
    dpi: int,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    bottom = max(p.panel["gridPos"]["y"] + p.panel["gridPos"]["h"] for p in results)
    unit_h = 0.25  # inches per grid row
    height = bottom * unit_h + 0.6
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    fig.suptitle(title, fontsize=14, y=1 - 0.15 / height)
    top_margin = 0.5 / height

    def box(gp: dict) -> list[float]:
        x0 = gp["x"] / GRID_COLUMNS
        w = gp["w"] / GRID_COLUMNS
        y_top = top_margin + gp["y"] * unit_h / height
        h = gp["h"] * unit_h / height
        return [x0, 1 - y_top - h, w, h]

    for res in results:
        panel, gp = res.panel, res.panel["gridPos"]
        kind = panel.get("type")
        if kind == "row":
            x0, y0, _, h = box(gp)
            fig.text(x0 + 0.005, y0 + h / 2, panel.get("title", ""), fontsize=13,
                     fontweight="bold", va="center", color="#1f4e79")  # fmt: skip
            continue
        x0, y0, w, h = box(gp)
        pad_x, pad_top, pad_bot = 0.032, 0.3 / height, 0.35 / height
        ax = fig.add_axes([x0 + pad_x, y0 + pad_bot, w - pad_x - 0.008, h - pad_top - pad_bot])
        ax.set_title(panel.get("title", ""), fontsize=10, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if not res.series:
            msg = "no data" if not res.errors else "query error"
            ax.text(0.5, 0.5, msg, ha="center", va="center", fontsize=12, color="gray",
                    transform=ax.transAxes)  # fmt: skip
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for s in res.series:
            ax.plot([datetime.fromtimestamp(t) for t in s.times], s.values, linewidth=1.2,
                    label=s.label[:40], alpha=0.35 if kind in VALUE_PANELS else 1.0)  # fmt: skip
        ax.set_xlim(datetime.fromtimestamp(window[0]), datetime.fromtimestamp(window[1]))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        ax.xaxis.set_major_locator(mdates.MinuteLocator())
        if kind in VALUE_PANELS:
            last = res.series[-1].values[-1] if len(res.series) == 1 else None
            text = unit_format(unit, last) if last is not None else f"{len(res.series)} series"
            ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=26, fontweight="bold",
                    color="#2a7a2a", transform=ax.transAxes)  # fmt: skip
        else:
            if unit and unit not in {"short", "none"}:
                ax.set_ylabel(unit, fontsize=7)
            ncol = 1 if len(res.series) <= 4 else 2
            ax.legend(fontsize=6.5, loc="upper left", ncol=ncol, framealpha=0.6)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    ap.add_argument("--dashboard", type=Path, default=Path("deploy/grafana/pdserve-dashboard.json"))
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"), help="output PNG")
    ap.add_argument("--minutes", type=float, default=5.0, help="time range: the last N minutes")
    ap.add_argument("--end", type=float, default=0.0, help="range end, unix time (default: now)")
    ap.add_argument("--step", type=int, default=5, help="query step in seconds ($__interval)")
    ap.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes")
    ap.add_argument("--width", type=float, default=20.0, help="figure width in inches")
    ap.add_argument("--dpi", type=int, default=90)
    args = ap.parse_args(argv)

    dashboard = json.loads(args.dashboard.read_text())
    end = args.end or time.time()
    start = end - args.minutes * 60
    panels = [p for p in flatten(dashboard.get("panels", [])) if "gridPos" in p]
    results = []
    for panel in panels:
        if panel.get("type") == "row":
            results.append(PanelResult(panel))
        else:
            results.append(
                evaluate(args.prometheus, panel, start, end, args.step, args.rate_interval)
            )

    width = max(len(r.panel.get("title", "")) for r in results)
    print(f"{'panel':<{width}}  series")
    for r in results:
        if r.panel.get("type") == "row":
            continue
        status = str(len(r.series)) if r.series else "no data"
        if r.errors:
            status += "  (errors: " + "; ".join(r.errors) + ")"
        print(f"{r.panel.get('title', ''):<{width}}  {status}")

    window = f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M} - {datetime.fromtimestamp(end):%H:%M}"
    title = f"{dashboard.get('title', 'dashboard')}  ({window})"
    render(results, title, args.out, (start, end), args.width, args.dpi)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
