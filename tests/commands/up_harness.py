"""Starts `pdserve up` for a test: on free ports, its run dir under the test's tmp_path,
returning once its banner is out."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from pdserve.procs import free_ports


def start_up(
    tmp_path: Path, *flags: str, timeout: float = 300
) -> tuple[subprocess.Popen, str, dict[str, int], Path]:
    """``pdserve up FLAGS`` plus ports and run dir: (process, banner, ports, run dir)."""
    meta, meta_http, master, router, http = free_ports(5)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "pdserve.commands.cli", "up", *flags,
        "--meta-port", str(meta), "--meta-http-port", str(meta_http), "--master-port",
        str(master), "--router-port", str(router), "--http-port", str(http),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = ""
    deadline = time.monotonic() + timeout
    while "Ctrl-C stops everything" not in banner:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"pdserve up did not come up: {proc.stderr.read()[-4000:]}")
        banner += proc.stdout.readline()
    return proc, banner, {"meta": meta, "master": master, "http": http}, run_dir


def shm_mapped(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files ``pids`` map (vLLM's queues, storage segments): those a clean stop
    must leave none of. Other tests may create their own files meanwhile, so checks name
    these rather than compare listings of the folder."""
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1].removesuffix(" (deleted)")
                if path.startswith("/dev/shm/"):
                    out.add(path)
    return out
