"""Fixtures for the meta tests: a real etcd on 127.0.0.1 and real ``pdserve meta`` processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.procs import ServiceProcess, service_args, start_service

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_endpoint(tmp_path: Path) -> Iterator[str]:
    """A fresh single-member etcd with a temporary data dir; killed by pid afterwards."""
    if not os.path.exists(ETCD):
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    log = (tmp_path / "etcd.log").open("w")
    proc = subprocess.Popen(
        [
            ETCD,
            "--name",
            "pdserve-test",
            "--data-dir",
            str(tmp_path / "etcd-data"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"pdserve-test=http://127.0.0.1:{peer}",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("etcd did not start:\n" + (tmp_path / "etcd.log").read_text()[-2000:])
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


MetaFactory = Callable[..., ServiceProcess]


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def start_meta(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[MetaFactory]:
    """Starts ``pdserve meta`` with the parametrized backend; stops every one it started."""
    started: list[ServiceProcess] = []
    endpoint = request.getfixturevalue("etcd_endpoint") if backend == "etcd" else ""

    def start(port: int = 0, http_port: int = 0, *extra: str) -> ServiceProcess:
        args = service_args(
            "meta",
            *extra,
            port=port,
            http_port=http_port,
            backend=backend,
            etcd_endpoints=endpoint or None,
        )
        proc = start_service(f"meta-{len(started)}", args, tmp_path, timeout=60)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
