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
            "pdserve.cli",
            "bench",
            "kvstore",
            "--sizes",
            "4KiB,64KiB",
            "--iterations",
            "3",
            "--batch",
            "4",
            "--transports",
            "shm,tcp",
            "--no-mooncake-store",
            "--tokens-compare",
            "--tls-compare",
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
    assert {("pdserve/tcp-notok", 4096, 1), ("pdserve/tcp-notok", 4096, 4)} <= systems
    assert "tcp with / without data tokens at 4 KiB single" in proc.stdout
    assert ("pdserve/tcp-tls", 65536, 1) in systems
    assert "tcp with / without mutual TLS on the control path at 64 KiB single" in proc.stdout
    for r in data["rows"]:
        assert r["iterations"] == 3 and r["put_gbps"] > 0 and r["get_gbps"] > 0
        assert 0 < r["get_p50_us"] <= r["get_p99_us"]
        assert r["mode"] == ("single" if r["batch"] == 1 else "batch")
    assert data["longest_prefix"]["pdserve"]["keys"] == 64
    assert set(data["control"]) == {"grpc", "wire", "grpc + mutual TLS", "wire + mutual TLS"}
    assert all(c["lookup_p50_us"] > 0 for c in data["control"].values())
