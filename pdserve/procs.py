"""Starting and stopping pdserve service processes (used by ``pdserve up`` and the tests).

Each child runs ``python -m pdserve.cli ...`` in its own process group, its output goes to a
log file, and it is "up" once it prints its READY line (see :mod:`pdserve.lifecycle`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.lifecycle import parse_ready


class ProcessStartError(RuntimeError):
    """A service exited or stayed silent before it printed its READY line."""


@dataclass
class ServiceProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests."""
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait for a clean exit, SIGKILL after ``timeout`` seconds."""
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
            except ProcessLookupError:
                pass
        return self.popen.returncode


def spawn_service(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> ServiceProcess:
    """Starts ``pdserve <args>`` in its own process group without waiting for it; stderr goes
    to ``log_dir/<name>.log``. ``prefix`` runs it through a wrapper that execs it (e.g.
    ``ip netns exec NS``), so the pid stays the service's. Call :func:`wait_ready` next."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("w") as log:
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdserve.cli", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            env=full_env,
            start_new_session=True,
        )
    return ServiceProcess(name, popen, log_path)


def wait_ready(proc: ServiceProcess, timeout: float = 120.0) -> ServiceProcess:
    """Waits for ``proc``'s READY line and fills ``proc.info``; raises
    :class:`ProcessStartError` with the log tail (and stops it) when it dies or times out."""
    popen = proc.popen
    assert popen.stdout is not None
    fd = popen.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        chunk = os.read(fd, 65536) if ready else b""
        if chunk:
            buf += chunk.decode(errors="replace")
            for line in buf.splitlines():
                info = parse_ready(line)
                if info is not None:
                    proc.info = info
                    with proc.log_path.open("a") as log:
                        log.write(buf)  # stdout so far (incl. READY) stays in the log
                    _drain_stdout_to_log(popen, proc.log_path)
                    return proc
        elif popen.poll() is not None:
            raise ProcessStartError(
                f"{proc.name} exited with code {popen.returncode} before it was ready:\n"
                f"{buf}\n{proc.log_tail()}"
            )
    proc.stop()
    raise ProcessStartError(
        f"{proc.name} was not ready within {timeout:.0f}s:\n{buf}\n{proc.log_tail()}"
    )


def start_service(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    prefix: Sequence[str] = (),
) -> ServiceProcess:
    """Starts ``pdserve <args>`` and waits for its READY line; raises
    :class:`ProcessStartError` with the log tail when it dies or times out."""
    return wait_ready(spawn_service(name, args, log_dir, env=env, prefix=prefix), timeout)


@contextlib.contextmanager
def local_store(
    log_dir: Path,
    *,
    segment_size: str | int = "256MiB",
    transports: str = "shm,tcp",
    node_id: str | None = None,
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A KV store on this host for benchmarks and tests: a master and one node process
    (``(master, node)``), both stopped by pid on exit and the node's shm files removed."""
    master = start_service(
        f"kv-master-{uuid.uuid4().hex[:6]}",
        ["kvstore", "master", "--port", "0", "--metrics-port", "-1"],
        log_dir,
        timeout=60,
    )
    node = None
    try:
        node = start_service(
            f"kv-node-{uuid.uuid4().hex[:6]}",
            ["kvstore", "node", "--master-address", master.info["grpc"], "--node-id",
             node_id or f"local-{uuid.uuid4().hex[:8]}", "--segment-sizes", str(segment_size),
             "--transports", transports],
            log_dir,
            env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
            timeout=60,
        )  # fmt: skip
        yield master, node
    finally:
        if node is not None:
            node.stop()
            for name in node.info.get("shm_names", []):
                Path("/dev/shm", name).unlink(missing_ok=True)
        master.stop()


def _drain_stdout_to_log(popen: subprocess.Popen, log_path: Path) -> None:
    """After READY, copy the child's remaining stdout into its log in a daemon thread."""
    import threading

    def pump() -> None:
        assert popen.stdout is not None
        with log_path.open("ab") as out:
            for line in popen.stdout:
                out.write(line)
                out.flush()

    threading.Thread(target=pump, name=f"log-{popen.pid}", daemon=True).start()
