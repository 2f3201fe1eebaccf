"""Systems the benchmark starts itself: a process in its own session with its log, waiting
until its HTTP API serves the model, a logs folder, and ``pdserve up`` on free ports."""

from __future__ import annotations

import contextlib
import http.client
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdserve.bench.serve.http import http_get, served_models
from pdserve.bench.serve.status import BenchError, say
from pdserve.procs import ServiceProcess, free_ports


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: dict[str, str] | None = None,
    cores: set[int] | None = None,
) -> ServiceProcess:
    """Starts ``argv`` in its own session (process group), output to ``log``; with ``cores``,
    pinned to them, it and every process it starts (as ``taskset -c``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        popen = subprocess.Popen(
            list(argv),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
    return ServiceProcess(name, popen, log)


def read_key(path: Path) -> str:
    """The API key in ``path`` (its first line; "" when there is none yet)."""
    try:
        return path.read_text().partition("\n")[0].strip()
    except OSError:
        return ""


def wait_http_ready(
    proc: ServiceProcess,
    base: str,
    model: str,
    timeout: float,
    marker: str | None = None,
    key_file: Path | None = None,
) -> None:
    """Waits until ``base/health`` is 200 and ``base/v1/models`` lists ``model`` (asked with
    the key in ``key_file`` once it is there) and, if given, ``marker`` appears in the log.

    Raises:
        BenchError: the process exited or the time ran out (with the log's tail).
    """
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise BenchError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was ready "
                f"(log {proc.log_path}):\n{proc.log_tail()}"
            )
        # HTTPException: something else answers on the port (a port race): not ready yet
        with contextlib.suppress(OSError, BenchError, http.client.HTTPException):
            key = read_key(key_file) if key_file else ""
            ready = http_get(f"{base}/health", 2.0)[0] == 200 and model in served_models(base, key)
            if ready and (marker is None or marker in proc.log_path.read_text(errors="replace")):
                return
        if time.monotonic() > deadline:
            raise BenchError(
                f"{proc.name} not ready within {timeout:.0f}s (log {proc.log_path}):\n{proc.log_tail()}"
            )
        time.sleep(0.5)


@contextlib.contextmanager
def logs_dir(keep: bool) -> Iterator[Path]:
    """A temporary folder for logs and run state, removed on success unless ``keep``."""
    import shutil

    path = Path(tempfile.mkdtemp(prefix="pdserve-bench-serve-"))
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(path, ignore_errors=True)
        else:
            say(f"logs kept in {path}")


def pdserve_up_argv(args_text: str, model: str, run_dir: Path) -> tuple[list[str], str]:
    """The ``pdserve up`` command line on free ports and its HTTP base URL."""
    user = shlex.split(args_text)
    http = free_ports(1)[0]
    ports = {
        "--http-port": http,
        "--router-port": free_ports(1)[0],
        "--meta-port": free_ports(1)[0],
        "--meta-http-port": free_ports(1)[0],
        "--master-port": free_ports(1)[0],
    }
    argv = [sys.executable, "-m", "pdserve.commands.cli", "up", "--run-dir", str(run_dir)]
    argv += ["--host", "127.0.0.1", *(x for kv in ports.items() for x in map(str, kv))]
    if "--model" not in user and not any(a.startswith("--model=") for a in user):
        argv += ["--model", model]
    return argv + user, f"http://127.0.0.1:{http}"


@contextlib.contextmanager
def started_pdserve(
    args_text: str, model: str, work: Path, timeout: float, env: dict[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """Runs ``pdserve up`` (with ``env`` added to its environment) for the duration of the
    block; yields its HTTP base URL and its API key ("" when ARGS turn auth off)."""
    from pdserve.commands.up import API_KEY_FILE

    run_dir = work / "pdserve-run"
    argv, base = pdserve_up_argv(args_text, model, run_dir)
    say(f"starting: {shlex.join(argv[1:])}")
    t0 = time.monotonic()
    if env:
        say(f"pdserve up's environment adds {' '.join(f'{k}={v}' for k, v in env.items())}")
    proc = spawn("pdserve up", argv, work / "pdserve-up.log", env)
    key_file = run_dir / API_KEY_FILE
    try:
        wait_http_ready(proc, base, model, timeout, marker="pdserve is up.", key_file=key_file)
        say(f"pdserve up ready in {time.monotonic() - t0:.1f}s at {base}")
        yield base, read_key(key_file)
    finally:
        say("stopping pdserve up")
        t1 = time.monotonic()
        proc.stop(120.0)
        say(f"pdserve up stopped in {time.monotonic() - t1:.1f}s (exit {proc.popen.returncode})")
