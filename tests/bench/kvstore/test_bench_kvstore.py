"""``pdserve bench kvstore`` runs end to end (tiny sizes) and writes consistent JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_kvstore_small_run(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.commands.cli",
            "bench",
            "kvstore",
            "--sizes",
            "4KiB,64KiB",
            "--iterations",
            "3",
            "--batch",
            "4",
            "--rounds",
            "2",
            "--transports",
            "shm,tcp",
            "--no-mooncake-store",
            "--tokens-compare",
            "--tls-compare",
            "--disk-dir",
            str(tmp_path / "disk"),
            "--json",
            str(out_json),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pdserve/tcp" in proc.stdout and "longest_prefix over 64 keys" in proc.stdout
    assert "one master round trip over wire" in proc.stdout
    data = json.loads(out_json.read_text())
    systems = {(r["system"], r["size"], r["batch"]) for r in data["rows"]}
    for system in ("memcpy", "pdserve/shm", "pdserve/tcp"):
        assert {(system, 4096, 1), (system, 65536, 1), (system, 4096, 4)} <= systems
    assert {("tcp-plain", 4096, 1), ("tcp-plain", 65536, 1)} <= systems
    assert {("tcp-plain", 4096, 4), ("tcp-plain", 65536, 4)} <= systems  # a batch's bytes
    assert ("tcp-plain-warm", 65536, 1) in systems
    assert {("disk-raw", 4096, 1), ("disk-raw", 65536, 1)} <= systems
    assert data["disk"]["dir"] == str((tmp_path / "disk").resolve())
    assert list((tmp_path / "disk").iterdir()) == []  # the raw disk files removed
    assert {("pdserve/tcp-notok", 4096, 1), ("pdserve/tcp-notok", 4096, 4)} <= systems
    assert "tcp with / without data tokens at 4 KiB single" in proc.stdout
    assert ("pdserve/tcp-tls", 65536, 1) in systems
    assert "tcp with / without mutual TLS on the control path at 64 KiB single" in proc.stdout
    assert {("pdserve/tcp-disk", 4096, 1), ("pdserve/tcp-disk", 4096, 16)} <= systems
    for r in data["rows"]:
        if r["system"] != "pdserve/tcp-disk":  # the disk tier's run reads what left memory
            assert r["iterations"] == 6  # 3 timed operations per round
        assert r["rounds"] == 2
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0
        assert 0 < r["get_p50_us"] <= r["get_p99_us"]
        assert r["mode"] == ("single" if r["batch"] == 1 else "batch")
    assert data["longest_prefix"]["pdserve"]["keys"] == 64
    assert data["longest_prefix"]["pdserve, length only"]["keys"] == 64
    assert len(data["rounds"]) == 2 and all(
        len(r["rows"]) == len(data["rows"]) for r in data["rounds"]
    )
    assert set(data["control"]) == {"grpc", "wire", "grpc + mutual TLS", "wire + mutual TLS"}
    assert all(c["lookup_p50_us"] > 0 for c in data["control"].values())


def test_median_rows_takes_each_figure_median_across_rounds() -> None:
    from pdserve.bench.kvstore.measure import Row, median_rows

    def row(system: str, get_gbps: float, put_p50: float, n: int = 3) -> Row:
        return Row(system, 1 << 20, n, "single", 1, 1.0, put_p50, 9.0, get_gbps, 5.0, 7.0)

    rounds = [
        [row("a", 1.0, 30.0), row("b", 4.0, 1.0)],
        [row("a", 9.0, 10.0)],
        [row("a", 2.0, 20.0, n=4), row("b", 6.0, 3.0)],
    ]
    got = {r.system: r for r in median_rows(rounds)}
    assert (got["a"].get_gbps, got["a"].put_p50_us, got["a"].iterations) == (2.0, 20.0, 10)
    assert got["a"].rounds == 3
    # "b" ran in two rounds only: the median of two is their mean.
    assert (got["b"].get_gbps, got["b"].put_p50_us, got["b"].rounds) == (5.0, 2.0, 2)


def test_disk_tier_ratio_lines_compare_each_object_with_the_raw_direct_read() -> None:
    from pdserve.bench.kvstore.measure import Row
    from pdserve.bench.kvstore.report import ratios

    def row(system: str, mode: str, batch: int, get_p50: float) -> Row:
        return Row(system, 1 << 20, 10, mode, batch, 1.0, 1.0, 1.0, 1.0, get_p50, get_p50)

    lines = ratios(
        [
            row("disk-raw-direct", "single", 1, 800.0),
            row("pdserve/tcp-disk", "single", 1, 1400.0),
            row("pdserve/tcp-disk", "batch", 16, 16 * 1000.0),
        ]
    )
    disk = sorted(line for line in lines if line.startswith("disk tier"))
    assert len(disk) == 2
    batch, single = disk
    assert "batch of 16" in batch and batch.endswith("p50 1000 vs 800 us, 1.25x")
    assert "looks up its own" in single and single.endswith("p50 1400 vs 800 us, 1.75x")


def test_the_ceiling_line_sets_mooncake_against_plain_tcp_of_the_same_mode() -> None:
    from pdserve.bench.kvstore.measure import Row
    from pdserve.bench.kvstore.report import ratios

    def row(system: str, batch: int, gbps: float, p50: float) -> Row:
        mode = "single" if batch == 1 else "batch"
        return Row(system, 1 << 20, 10, mode, batch, gbps, p50, p50, gbps, p50, p50)

    lines = ratios(
        [
            row("mooncake-store", 1, 1.0, 1000.0),
            row("tcp-plain", 1, 2.5, 400.0),
            row("pdserve/tcp+lookup", 1, 2.0, 500.0),
            row("mooncake-store", 16, 1.5, 11000.0),
            row("tcp-plain", 16, 4.5, 3700.0),
            row("pdserve/tcp", 16, 3.0, 5000.0),
        ]
    )
    ceilings = sorted(line for line in lines if line.startswith("ceiling"))
    assert len(ceilings) == 2
    batch, single = ceilings
    assert batch.startswith("ceiling at 1 MiB batch: tcp-plain / mooncake-store get 3.00x")
    assert "tcp+lookup" not in batch  # no pdserve batch row to set against it
    assert single.startswith("ceiling at 1 MiB single: tcp-plain / mooncake-store get 2.50x")
    assert single.endswith("; tcp+lookup 2.00x, 80% of tcp-plain")
    # "tcp / plain" compares within a mode: the batch row against the batch's plain tcp.
    assert "tcp / plain loopback tcp at 1 MiB batch: get 67%" in lines


def test_the_side_by_side_line_sets_each_system_against_the_others() -> None:
    from pdserve.bench.kvstore.side_by_side import SideBySide

    s = SideBySide(
        1 << 20,
        16,
        32,
        {"tcp-plain": 3000.0, "pdserve/tcp+lookup": 4000.0, "mooncake-store": 9000.0},
        {"tcp-plain": 6.0, "pdserve/tcp+lookup": 4.5, "mooncake-store": 2.0},
    )
    assert s.line() == (
        "side by side at 1 MiB batch of 16 (32 gets each, in turn): pdserve/tcp+lookup p50 "
        "4000 us, tcp-plain 3000, mooncake-store 9000; tcp+lookup / mooncake-store 2.25x "
        "GB/s (2.25x p50), ceiling tcp-plain / mooncake-store 3.00x (3.00x p50), "
        "tcp+lookup at 75% of tcp-plain"
    )


@pytest.mark.slow
def test_side_by_side_gets_every_system_in_turn_and_checks_the_bytes(tmp_path: Path) -> None:
    """Real processes: the tcp-plain peer, a pdserve store, a Mooncake Store. Every system
    makes the same number of gets per size and mode (and each store's bytes are compared
    inside the run: a wrong byte raises)."""
    from pdserve.store.mooncake_backend import available

    if not available():
        pytest.skip("Mooncake is not installed (pip install -e '.[mooncake]')")
    from pdserve.bench.kvstore.side_by_side import SYSTEMS, bench_side_by_side

    got = bench_side_by_side([4096, 65536], 4, 3, tmp_path)
    assert [(s.size, s.batch, s.iterations) for s in got] == [
        (4096, 1, 4),
        (65536, 1, 4),
        (4096, 3, 4),
        (65536, 3, 4),
    ]
    for s in got:
        assert set(s.p50_us) == set(s.gbps) == set(SYSTEMS)
        assert all(v > 0 for v in [*s.p50_us.values(), *s.gbps.values()])
        assert s.line().startswith(f"side by side at {s.size // 1024} KiB")


def test_per_round_lines_give_each_rounds_ratio_and_their_median() -> None:
    from pdserve.bench.kvstore.measure import Row
    from pdserve.bench.kvstore.report import per_round

    def row(system: str, batch: int, gbps: float) -> Row:
        mode = "single" if batch == 1 else "batch"
        return Row(system, 1 << 20, 10, mode, batch, gbps, 1.0, 1.0, gbps, 1.0, 1.0)

    rounds = [
        [row("mooncake-store", 1, 1.0), row("pdserve/tcp+lookup", 1, 2.5)],
        [row("mooncake-store", 1, 1.0), row("pdserve/tcp+lookup", 1, 3.5)],
        [
            row("mooncake-store", 1, 2.0),
            row("pdserve/tcp+lookup", 1, 6.2),
            row("mooncake-store", 16, 1.0),
            row("pdserve/tcp+lookup", 16, 2.0),
            row("pdserve/tcp", 16, 9.0),  # not the system asked for
        ],
    ]
    batch, single = per_round(rounds)
    assert single == (
        "tcp+lookup / mooncake-store at 1 MiB single, per round: 2.50x, 3.50x, 3.10x (median 3.10x)"
    )
    # a size and mode only one round measured: that round's ratio alone
    assert batch == "tcp+lookup / mooncake-store at 1 MiB batch, per round: 2.00x (median 2.00x)"
    assert per_round([[row("pdserve/tcp+lookup", 1, 2.0)]]) == []  # no baseline, no line
