"""Where the cores went (pdserve.bench.serve.cpu): roles from command lines and titles, the
window's CPU by role from two samples, the process tree, and a real child's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.serve import cpu
from pdserve.bench.serve.cpu import CpuSample, cpu_report, format_cpu, role_of

PY = "/v/bin/python"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([PY, "-m", "pdserve.commands.cli", "kvstore", "master", "--port", "1"], "kvstore master"),
        ([PY, "-m", "pdserve.commands.cli", "kvstore", "node", "--node-id", "n"], "kvstore node"),
        ([PY, "-m", "pdserve.commands.cli", "router", "--port", "1"], "router"),
        ([PY, "-m", "pdserve.commands.cli", "decode", "--engine", "vllm"], "decode"),
        ([PY, "-m", "pdserve.commands.cli", "prefill"], "prefill"),
        ([PY, "-m", "pdserve.commands.cli", "meta", "--port", "1"], "meta"),
        ([PY, "-m", "pdserve.commands.cli", "up", "--run-dir", "r"], "up"),
        ([PY, "-m", "pdserve.commands.cli", "certs"], "pdserve (other)"),
        ([PY, "-m", "pdserve.bench.serve.proxy", "8000", "http://a"], "round-robin proxy"),
        (["/v/bin/vllm-router", "--policy", "cache_aware"], "vllm-router"),
        (["/v/bin/python", "/v/bin/vllm", "serve", "/models/m"], "vllm api server"),
        (["/v/bin/vllm", "serve", "/models/m"], "vllm api server"),
        ([PY, "-m", "pdserve.commands.vllm", "serve", "/m", "--port", "1"], "vllm api server"),
        ([PY, "-B", "-c", "from multiprocessing.resource_tracker import main;main(24)"], "other"),
        (["sleep", "1"], "other"),
    ],
)
def test_roles_come_from_the_command_line(argv: list[str], expected: str) -> None:
    assert role_of(argv) == expected


def test_the_window_counts_what_each_role_spent_in_it() -> None:
    before = CpuSample(10.0, {1: ("bench client", 5.0), 2: ("router", 3.0), 3: ("decode", 1.0)})
    after = CpuSample(
        20.0,
        {
            1: ("bench client", 6.0),
            2: ("router", 5.0),
            3: ("decode", 1.5),
            4: ("vllm model runner", 8.0),  # born in the window: counts from 0
            5: ("vllm engine core", 2.0),
            6: ("vllm model runner", 7.0),
        },
    )
    report = cpu_report(before, after, requests=25)
    assert report.window_s == 10.0
    assert report.by_role == {
        "bench client": 1.0,
        "router": 2.0,
        "decode": 0.5,
        "vllm model runner": 15.0,
        "vllm engine core": 2.0,
    }
    assert report.engine_s == 17.0
    assert report.serving_s == 2.5  # router and worker service: not the engines, not the client
    doc = report.to_json()
    assert doc["engines_busy_cores"] == pytest.approx(1.7)
    assert doc["control_plane_cpu_ms_per_request"] == pytest.approx(100.0)
    lines = list(format_cpu(report))
    assert lines[0].split() == ["vllm", "model", "runner", "1.50", "cores", "(15.0", "s)"]
    assert lines[-1].startswith("  engines busy 1.70 of ")
    assert "control plane 100.0 ms CPU per request" in lines[-1]


def test_no_request_no_per_request_figure() -> None:
    report = cpu_report(CpuSample(0.0, {}), CpuSample(1.0, {2: ("router", 0.1)}), requests=0)
    assert report.to_json()["control_plane_cpu_ms_per_request"] is None


def _fake_proc(root: Path, pid: int, ppid: int, comm: str, argv: list[str], ticks: int) -> None:
    d = root / str(pid)
    d.mkdir()
    # pid (comm) state ppid ... utime (14th) stime (15th): a comm with spaces and a ")"
    fields = ["S", str(ppid), *["0"] * 9, str(ticks), str(ticks), *["0"] * 5]
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_the_tree_below_the_benchmark_is_the_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_proc(tmp_path, 10, 1, "pdserve", [PY, "pdserve", "bench", "serve"], 100)
    _fake_proc(tmp_path, 11, 10, "python", [PY, "-m", "pdserve.commands.cli", "up"], 10)
    _fake_proc(tmp_path, 12, 11, "python", [PY, "-m", "pdserve.commands.cli", "decode"], 20)
    _fake_proc(tmp_path, 13, 12, "VLLM::EngineCor", ["VLLM::EngineCore"], 30)
    _fake_proc(tmp_path, 14, 13, "VLLM::Worker", ["VLLM::Worker"], 40)
    _fake_proc(tmp_path, 20, 1, "odd) name", ["other"], 50)  # not below the benchmark
    (tmp_path / "self").mkdir()  # not a process
    monkeypatch.setattr(cpu, "PROC", tmp_path)
    assert sorted(cpu.descendants(10)) == [11, 12, 13, 14]
    tick = os.sysconf("SC_CLK_TCK")
    got = cpu.sample(10, 1.0).cpu_s
    assert got == {
        10: ("bench client", 200 / tick),
        11: ("up", 20 / tick),
        12: ("decode", 40 / tick),
        13: ("vllm engine core", 60 / tick),
        14: ("vllm model runner", 80 / tick),
    }


@pytest.mark.slow
def test_a_real_child_s_cpu_is_counted() -> None:
    before = cpu.sample(os.getpid(), 0.0)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "input()"], stdin=subprocess.PIPE)
    try:
        # the child has burnt its 0.3 s of CPU once its CPU time says so (no wall-clock guess)
        while (cpu.cpu_seconds(child.pid) or 0.0) < 0.3:
            assert child.poll() is None
        after = cpu.sample(os.getpid(), 1.0)
    finally:
        child.communicate(b"\n", timeout=30)
    report = cpu_report(before, after, requests=1)
    assert child.pid in after.cpu_s and child.pid not in before.cpu_s
    assert report.by_role["other"] >= 0.3
    assert report.by_role["bench client"] >= 0.0
