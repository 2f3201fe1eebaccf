"""`pdserve up` end to end: the printed examples return text; SIGINT leaves nothing behind."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()}


def test_up_serves_the_printed_examples_and_stops_cleanly(tmp_path: Path):
    meta, meta_http, master, router, http = _free_ports(5)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "up", "--engine", "torch", "--model", "tiny", "--chunk-size", "16",
        "--meta-port", str(meta), "--meta-http-port", str(meta_http), "--master-port",
        str(master), "--router-port", str(router), "--http-port", str(http),
        "--segment-size", "64MiB", "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = ""
        deadline = time.monotonic() + 300
        while "Ctrl-C stops everything" not in banner:
            assert time.monotonic() < deadline, "pdserve up did not come up"
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"pdserve up exited: {proc.stderr.read()}"
            banner += line
        children = _children(proc.pid)
        # meta, master, node, router and the default topology: one worker per core (at most
        # 8), each prefilling and decoding
        assert len(children) == 4 + min(os.cpu_count() or 1, 8)
        curl = re.search(r"(curl -s .*?\n.*?-d '.*?')", banner, re.S).group(1)
        out = subprocess.run(
            ["bash", "-c", curl.replace("\\\n", " ")], capture_output=True, text=True, timeout=120
        ).stdout
        assert '"text_completion"' in out and '"finish_reason": "length"' in out, out
        gen = re.search(r"(\S*pdserve generate .*)", banner).group(1)
        gen_args = shlex.split(gen)[1:]
        res = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *gen_args], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert res.returncode == 0 and res.stdout.strip(), res.stderr
        assert "[length]" in res.stderr
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "status", "--meta", f"127.0.0.1:{meta}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        for role in ("decode", "kvstore-master", "kvstore-node"):
            assert role in status.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"pid {pid} still runs"
    assert not [f for f in os.listdir("/dev/shm") if "node-0-seg" in f and str(run_dir) in f]
    assert not any(Path("/dev/shm").glob(f"pdserve-kv-node-0-{master}-seg*"))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
