"""Starting and stopping pdserve service processes (used by ``pdserve up`` and the tests).

Each child runs ``python -m pdserve.commands.cli ...`` in its own process group, its output goes to a
log file, and it is "up" once it prints its READY line (see :mod:`pdserve.lifecycle`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.lifecycle import parse_ready

log = logging.getLogger(__name__)

#: How long a SIGKILLed service's processes may take to exit before the segments they map
#: are given up on (an engine's exit frees GiBs of KV cache; on a loaded machine, seconds).
GROUP_EXIT_S = 30.0


class ProcessStartError(RuntimeError):
    """A service exited or stayed silent before it printed its READY line."""


@dataclass
class ServiceProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    #: The ``psm_*`` shared-memory segments its processes were seen to map (vLLM's message
    #: queues, 300-400 MB a worker) and their ``sem.mp-*`` semaphores, removed once the
    #: service is gone if no live process maps them: a service killed before its own shutdown
    #: ends leaves them behind (:mod:`pdserve.engines.shm_segments`).
    segments: set[str] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def note_segments(self) -> None:
        """Adds the segments the service's processes map now to :attr:`segments`: its tree
        and its process group (helpers outlive a service process that exited first)."""
        from pdserve.engines import shm_segments

        self.segments |= shm_segments.mapped_files(self.popen.pid, tree=self.alive())

    def _remove_segments(self) -> None:
        """Once the process group is gone (SIGKILLed: waits up to :data:`GROUP_EXIT_S` for
        its last process to exit; zombies map nothing and are not waited for), removes the
        noted segments no live process maps. A killed engine process maps its segments until
        its exit has torn down its memory (GiBs of KV cache), seconds on a loaded machine."""
        from pdserve.engines import shm_segments

        if not self.segments:
            return
        deadline = time.monotonic() + GROUP_EXIT_S
        while shm_segments.group(self.popen.pid):
            if time.monotonic() > deadline:
                log.warning(
                    "%s: processes of its group still run %.0f s after SIGKILL; segments they "
                    "map stay",
                    self.name,
                    GROUP_EXIT_S,
                )
                break
            time.sleep(0.05)
        left, self.segments = self.segments - shm_segments.in_use(), set()
        shm_segments.remove(left)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests."""
        self.note_segments()
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        self._remove_segments()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, wait for a clean exit, SIGKILL after ``timeout``
        seconds; then SIGKILL whatever is left in the group (helpers such as vLLM's engine
        core must not outlive their service), and remove the shared-memory segments it left
        (:attr:`segments`)."""
        self.note_segments()
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self._remove_segments()
        return self.popen.returncode


#: The group every service started as a user of its own (``user``, ``pdserve up
#: --isolate-services``: :mod:`pdserve.commands.up_isolation`) is in besides its own: the
#: group that may read the API key file.
SHARED_GID = 64199


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn_service(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    append: bool = False,
    user: int | None = None,
) -> ServiceProcess:
    """Starts ``pdserve <args>`` in its own process group without waiting for it; stderr goes
    to ``log_dir/<name>.log`` (``append``: after what an earlier run wrote). ``prefix`` runs it
    through a wrapper that execs it (e.g. ``ip netns exec NS``), so the pid stays the
    service's. ``user``: the user (and group) id it runs as, with the shared service group
    (``pdserve up --isolate-services``; takes root). Call :func:`wait_ready` next."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("a" if append else "w") as log:
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdserve.commands.cli", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            env=full_env,
            start_new_session=True,
            **_as_user(user),
        )
    return ServiceProcess(name, popen, log_path)


def _as_user(uid: int | None) -> dict[str, object]:
    if uid is None:
        return {}
    return {"user": uid, "group": uid, "extra_groups": [SHARED_GID]}


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
                    proc.note_segments()  # a started engine maps its queues by now
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


#: The ``pdserve`` subcommand that runs each service.
SERVICE_COMMANDS: dict[str, tuple[str, ...]] = {
    "meta": ("meta",),
    "kvstore-master": ("kvstore", "master"),
    "kvstore-node": ("kvstore", "node"),
    "prefill": ("prefill",),
    "decode": ("decode",),
    "router": ("router",),
    "mooncake-master": ("mooncake", "master"),
    "mooncake-storage": ("mooncake", "storage"),
    "etcd": ("etcd",),
}


def flag_args(**values: object) -> list[str]:
    """``flag_args(chunk_size=256, meta=None)`` -> ``["--chunk-size", "256"]``: one
    ``--flag value`` pair per value, underscores as dashes; a bool is ``--flag`` or
    ``--no-flag`` (the config's boolean flags take no value), a mapping is JSON; None leaves
    the flag out."""
    out: list[str] = []
    for k, v in values.items():
        flag = k.replace("_", "-")
        if isinstance(v, bool):
            out.append(f"--{flag}" if v else f"--no-{flag}")
        elif isinstance(v, dict):
            out += [f"--{flag}", json.dumps(v)]
        elif v is not None:
            out += [f"--{flag}", str(v)]
    return out


def service_args(service: str, *extra: str, **flags: object) -> list[str]:
    """The ``pdserve`` arguments that start ``service`` (a :data:`SERVICE_COMMANDS` key) with
    ``flags`` (see :func:`flag_args`), then ``extra`` verbatim: the one place a service's
    command line is spelled, for ``pdserve up``, benchmarks and tests."""
    return [*SERVICE_COMMANDS[service], *flag_args(**flags), *extra]


def start_master(log_dir: Path, *extra: str, name: str = "", **flags: object) -> ServiceProcess:
    """A ``pdserve kvstore master`` on a free port without /metrics, its state dir in
    ``log_dir`` (unless ``flags`` say otherwise), READY."""
    name = name or f"kv-master-{uuid.uuid4().hex[:6]}"
    flags = {"port": 0, "metrics_port": -1, **flags}
    if "--state-dir" not in extra:
        flags.setdefault("state_dir", log_dir / f"{name}-state")
    return start_service(
        name,
        service_args("kvstore-master", *extra, **flags),
        log_dir,
        timeout=60,
    )


def start_node(
    master_address: str,
    log_dir: Path,
    *extra: str,
    node_id: str = "",
    segment_sizes: str | int = "64MiB",
    transports: str = "shm,tcp",
    env: dict[str, str] | None = None,
    **flags: object,
) -> ServiceProcess:
    """A ``pdserve kvstore node`` of ``master_address`` (Mooncake's TE bound to 127.0.0.1),
    READY; its log is ``log_dir/<node_id>.log``."""
    node_id = node_id or f"n{uuid.uuid4().hex[:8]}"
    args = service_args(
        "kvstore-node",
        *extra,
        master_address=master_address,
        node_id=node_id,
        segment_sizes=segment_sizes,
        transports=transports,
        **flags,
    )
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", **(env or {})}
    return start_service(node_id, args, log_dir, env=env, timeout=60)


def remove_shm(node: ServiceProcess) -> None:
    """Unlinks a node's shared-memory files (a cleanly stopped node removes its own; this is
    for one that was killed)."""
    for name in node.info.get("shm_names", []):
        Path("/dev/shm", name).unlink(missing_ok=True)


@contextlib.contextmanager
def local_store(
    log_dir: Path,
    *,
    segment_size: str | int = "256MiB",
    transports: str = "shm,tcp",
    node_id: str | None = None,
    master_flags: dict[str, object] | None = None,
    node_flags: dict[str, object] | None = None,
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A KV store on this host for benchmarks and tests: a master (``master_flags`` as
    :func:`start_master`) and one node process (``node_flags`` as :func:`start_node`),
    ``(master, node)``, both stopped by pid on exit and the node's shm files removed."""
    master = start_master(log_dir, **(master_flags or {}))
    node = None
    try:
        node = start_node(
            master.info["grpc"],
            log_dir,
            node_id=node_id or f"local-{uuid.uuid4().hex[:8]}",
            segment_sizes=segment_size,
            transports=transports,
            **(node_flags or {}),
        )
        yield master, node
    finally:
        if node is not None:
            node.stop()
            remove_shm(node)
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
