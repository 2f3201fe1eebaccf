"""What ``pdserve bench kvstore`` prints and draws: the table, the ratios the targets name,
and get GB/s per size per system as a PNG."""

from __future__ import annotations

import statistics
from pathlib import Path

from pdserve.bench.kvstore.measure import Row, fmt_size


def render(
    rows: list[Row], prefix: dict[str, dict[str, float]], control: dict[str, dict[str, float]]
) -> str:
    head = (
        f"{'system':<24}{'size':>8}{'batch':>6}{'n':>5}  {'put GB/s':>9}{'p50 us':>10}"
        f"{'p99 us':>10}  {'get GB/s':>9}{'p50 us':>10}{'p99 us':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.mode != "single", r.size, r.system)):
        lines.append(
            f"{r.system:<24}{fmt_size(r.size):>8}{r.batch:>6}{r.iterations:>5}  "
            f"{r.put_gbps:>9.2f}{r.put_p50_us:>10.0f}{r.put_p99_us:>10.0f}  "
            f"{r.get_gbps:>9.2f}{r.get_p50_us:>10.0f}{r.get_p99_us:>10.0f}"
        )
    lines.append("")
    for name, c in control.items():
        lines.append(
            f"one master round trip over {name}: lookup of 1 key p50 {c['lookup_p50_us']:.0f} us"
            f" (p99 {c['lookup_p99_us']:.0f}), longest_prefix of 64 p50 "
            f"{c['prefix64_p50_us']:.0f} us (p99 {c['prefix64_p99_us']:.0f})"
        )
    for name, p in prefix.items():
        lines.append(
            f"longest_prefix over {p['keys']:.0f} keys ({name}): p50 {p['p50_us']:.0f} us, "
            f"p99 {p['p99_us']:.0f} us"
        )
    lines += ratios(rows)
    return "\n".join(lines)


def ratios(rows: list[Row]) -> list[str]:
    """The comparisons the issue's targets name, one line each."""
    by = {(r.system, r.size, r.mode): r for r in rows}
    lines = []
    for r in sorted(rows, key=lambda r: (r.mode, r.size)):
        mc = by.get(("mooncake-store", r.size, r.mode))
        mem = by.get(("memcpy", r.size, r.mode))
        plain = by.get(("tcp-plain", r.size, r.mode))
        where = f"{fmt_size(r.size)} {r.mode}"
        if r.system == "tcp-plain" and mc is not None:
            lines.append(ceiling(r, mc, by.get(("pdserve/tcp+lookup", r.size, r.mode))))
        if r.system in ("pdserve/tcp", "pdserve/tcp+sum") and mc is not None:
            lines.append(
                f"{r.system[8:]} / mooncake-store at {where}: get {r.get_gbps / mc.get_gbps:.2f}x "
                f"(p50 {r.get_p50_us:.0f} vs {mc.get_p50_us:.0f} us), "
                f"put {r.put_gbps / mc.put_gbps:.2f}x"
            )
        tls = by.get(("pdserve/tcp-tls", r.size, r.mode))
        if r.system == "pdserve/tcp" and tls is not None:
            lines.append(
                f"tcp with / without mutual TLS on the control path at {where}: get "
                f"{tls.get_gbps:.2f} vs {r.get_gbps:.2f} GB/s (p50 {tls.get_p50_us:.0f} vs "
                f"{r.get_p50_us:.0f} us), put p50 {tls.put_p50_us:.0f} vs {r.put_p50_us:.0f} us"
            )
        notok = by.get(("pdserve/tcp-notok", r.size, r.mode))
        if r.system == "pdserve/tcp" and notok is not None:
            lines.append(
                f"tcp with / without data tokens at {where}: get {r.get_gbps:.2f} vs "
                f"{notok.get_gbps:.2f} GB/s (p50 {r.get_p50_us:.0f} vs {notok.get_p50_us:.0f} us), "
                f"put p50 {r.put_p50_us:.0f} vs {notok.put_p50_us:.0f} us"
            )
        if r.system == "pdserve/tcp" and plain is not None and r.size >= 1 << 20:
            lines.append(
                f"tcp / plain loopback tcp at {where}: get {r.get_gbps / plain.get_gbps:.0%}"
            )
        looked = by.get((f"{r.system}+lookup", r.size, r.mode))
        if r.system.startswith("pdserve/") and looked is not None:
            lines.append(
                f"{r.system[8:]} get after longest_prefix (+lookup, the lookup timed) / without "
                f"(each get looks up its own) at {where}: {looked.get_gbps:.2f} vs "
                f"{r.get_gbps:.2f} GB/s (p50 {looked.get_p50_us:.0f} vs {r.get_p50_us:.0f} us)"
            )
        raw = by.get(("disk-raw-direct", r.size, "single"))
        if r.system == "pdserve/tcp-disk" and raw is not None and raw.get_p50_us > 0:
            each = r.get_p50_us / r.batch  # a batch is timed as one operation
            how = (
                "each get looks up its own"
                if r.batch == 1
                else (
                    f"per object of a batch of {r.batch}: longest_prefix, then the batch, as the "
                    "connector reads"
                )
            )
            lines.append(
                f"disk tier / raw O_DIRECT read at {where} ({how}): p50 {each:.0f} vs "
                f"{raw.get_p50_us:.0f} us, {each / raw.get_p50_us:.2f}x"
            )
        if r.system == "pdserve/shm" and mem is not None:
            lines.append(
                f"shm / memcpy at {where}: put {r.put_gbps / mem.put_gbps:.0%}, "
                f"get {r.get_gbps / mem.get_gbps:.0%}"
            )
    return lines


def per_round(
    rounds: list[list[Row]], system: str = "pdserve/tcp+lookup", against: str = "mooncake-store"
) -> list[str]:
    """Per size and mode, ``system``'s get GB/s over ``against``'s in each round, in the
    rounds' order, and the median of those ratios: the spread the medians of each system hide
    (on a noisy machine the rounds of one run can fall either side of a target)."""
    found: dict[tuple[str, int], list[float]] = {}
    for rows in rounds:
        by = {(r.system, r.size, r.mode): r for r in rows}
        for r in rows:
            base = by.get((against, r.size, r.mode))
            if r.system == system and base is not None and base.get_gbps > 0:
                found.setdefault((r.mode, r.size), []).append(r.get_gbps / base.get_gbps)
    return [
        f"{system.removeprefix('pdserve/')} / {against} at {fmt_size(size)} {mode}, per round: "
        + ", ".join(f"{x:.2f}x" for x in xs)
        + f" (median {statistics.median(xs):.2f}x)"
        for (mode, size), xs in sorted(found.items())
    ]


def ceiling(plain: Row, mc: Row, looked: Row | None) -> str:
    """The most a tcp get can be ahead of Mooncake Store at ``plain``'s size and mode in this
    run: plain loopback tcp (the same bytes, the same socket settings and streams, nothing
    else: no request to decode, no grant to check, no lookup) over Mooncake Store's get, and
    where pdserve's connector-style get (``looked``, +lookup) stands against it."""
    where = f"{fmt_size(plain.size)} {plain.mode}"
    line = (
        f"ceiling at {where}: tcp-plain / mooncake-store get "
        f"{plain.get_gbps / mc.get_gbps:.2f}x (p50 {plain.get_p50_us:.0f} vs "
        f"{mc.get_p50_us:.0f} us): a store's get over this loopback with these socket "
        "settings moves the same bytes and does more, so no further ahead in this run"
    )
    if looked is not None:
        line += (
            f"; tcp+lookup {looked.get_gbps / mc.get_gbps:.2f}x, "
            f"{looked.get_gbps / plain.get_gbps:.0%} of tcp-plain"
        )
    return line


def plot(rows: list[Row], path: Path) -> Path:
    """get GB/s per object size, one line per system, single and batch side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("single", "batch") if any(r.mode == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for system in sorted({r.system for r in rows if r.mode == mode}):
            pts = sorted(
                (r.size, r.get_gbps) for r in rows if r.mode == mode and r.system == system
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("object size (bytes)")
        ax.set_ylabel("get GB/s")
        ax.set_title(f"KV store get, {'one object' if mode == 'single' else 'batched'} per call")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
