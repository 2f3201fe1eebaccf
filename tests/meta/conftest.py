"""Fixtures for the meta tests: a real etcd on 127.0.0.1 and real ``pdserve meta`` processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.commands import certs
from pdserve.procs import ServiceProcess, service_args, start_service

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etcd(tmp_path: Path, tls: Path | None = None) -> Iterator[str]:
    """A fresh single-member etcd with a temporary data dir; killed by pid afterwards. With
    ``tls`` (a ``pdserve certs`` folder) clients speak TLS and must present a certificate of
    its CA; the server uses ``etcd.crt``."""
    if not os.path.exists(ETCD):
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    scheme = "https" if tls else "http"
    log = (tmp_path / "etcd.log").open("w")
    args = [
        ETCD,
        "--name",
        "pdserve-test",
        "--data-dir",
        str(tmp_path / "etcd-data"),
        "--listen-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"pdserve-test=http://127.0.0.1:{peer}",
    ]
    ctx = None
    if tls:
        args += [f"--cert-file={tls / 'etcd.crt'}", f"--key-file={tls / 'etcd.key'}"]
        args += [f"--trusted-ca-file={tls / 'ca.crt'}", "--client-cert-auth"]
        ctx = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        ctx.load_cert_chain(tls / "etcd.crt", tls / "etcd.key")
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                url = f"{scheme}://127.0.0.1:{client}/health"
                with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
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


@pytest.fixture
def etcd_endpoint(tmp_path: Path) -> Iterator[str]:
    """A plaintext etcd (see :func:`_etcd`)."""
    yield from _etcd(tmp_path)


@pytest.fixture
def etcd_tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An etcd that takes TLS with client certificates only, and the ``pdserve certs`` folder
    whose CA signed its certificate and the client's (``meta.crt``)."""
    certdir = tmp_path / "etcd-certs"
    certs.make(certdir, ["meta:etcd", "meta:meta"])
    for endpoint in _etcd(tmp_path, certdir):
        yield endpoint, certdir


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
