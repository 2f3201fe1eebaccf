"""A local Mooncake Store for tests and benchmarks: a ``mooncake_master`` child process plus
one process contributing a memory segment (``pdserve mooncake storage``), started and
stopped as one (:class:`MooncakeCluster`). The client is
:class:`pdserve.store.mooncake_backend.MooncakeStoreClient`; the services behind
``pdserve up --store-backend mooncake`` are :mod:`pdserve.commands.mooncake`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.lifecycle import parse_ready
from pdserve.procs import free_ports


def master_binary() -> Path:
    """The ``mooncake_master`` executable shipped inside the installed wheel."""
    import mooncake

    path = Path(mooncake.__file__).with_name("mooncake_master")
    if not path.exists():
        raise FileNotFoundError(f"mooncake_master not found next to {mooncake.__file__}")
    return path


def master_command(host: str, port: int, metrics_port: int, lease_ms: int) -> list[str]:
    """The ``mooncake_master`` command line: RPC and metrics bound to ``host``, no HTTP
    metadata server of its own (pdserve meta serves that protocol)."""
    return [
        str(master_binary()),
        f"-rpc_address={host}",
        f"-rpc_port={port}",
        f"-metrics_host={host}",
        f"-metrics_port={metrics_port}",
        f"-default_kv_lease_ttl={lease_ms}",
        "-enable_http_metadata_server=false",
    ]


def _stop_group(popen: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after 10 s."""
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` child process (its own process group) on 127.0.0.1."""

    popen: subprocess.Popen
    address: str

    @classmethod
    def start(cls, log_path: Path, *, lease_ms: int = 5000) -> MooncakeMaster:
        port, metrics = free_ports(2)
        with log_path.open("w") as log:
            popen = subprocess.Popen(
                master_command("127.0.0.1", port, metrics, lease_ms),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                raise RuntimeError(f"mooncake_master exited: {log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return cls(popen, address)
            except OSError:
                time.sleep(0.1)
        os.killpg(popen.pid, signal.SIGKILL)
        raise RuntimeError("mooncake_master did not listen within 20 s")

    def stop(self) -> None:
        _stop_group(self.popen)


@dataclass
class MooncakeCluster:
    """``mooncake_master`` plus one ``pdserve mooncake storage`` process contributing
    ``segment_size`` of memory."""

    master: MooncakeMaster
    storage: subprocess.Popen

    @property
    def address(self) -> str:
        return self.master.address

    @classmethod
    def start(
        cls, log_dir: Path, segment_size: str | int, *, lease_ms: int = 5000
    ) -> MooncakeCluster:
        log_dir.mkdir(parents=True, exist_ok=True)
        master = MooncakeMaster.start(log_dir / "mooncake_master.log", lease_ms=lease_ms)
        with (log_dir / "mooncake_storage.log").open("w") as log:
            storage = subprocess.Popen(
                [sys.executable, "-m", "pdserve.commands.cli", "mooncake", "storage",
                 "--master", master.address, "--segment-size", str(segment_size)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
                env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
            )  # fmt: skip
        cluster = cls(master, storage)
        deadline = time.monotonic() + 60
        assert storage.stdout is not None
        while time.monotonic() < deadline:
            line = storage.stdout.readline()
            if not line:
                cluster.stop()
                raise RuntimeError("mooncake storage process exited before READY")
            if parse_ready(line) is not None:
                return cluster
        cluster.stop()
        raise RuntimeError("mooncake storage process not ready in 60 s")

    def stop(self) -> None:
        _stop_group(self.storage)
        self.master.stop()
