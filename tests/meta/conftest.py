"""Fixtures for the meta tests: a real etcd on 127.0.0.1 and real ``pdserve meta`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from etcd_harness import run_etcd

from pdserve.commands import certs
from pdserve.procs import ServiceProcess, service_args, start_service


@pytest.fixture
def etcd_endpoint(tmp_path: Path) -> Iterator[str]:
    """A plaintext etcd (see :func:`etcd_harness.run_etcd`)."""
    yield from run_etcd(tmp_path)


@pytest.fixture
def etcd_tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An etcd that takes TLS with client certificates only, and the ``pdserve certs`` folder
    whose CA signed its certificate and the client's (``meta.crt``)."""
    certdir = tmp_path / "etcd-certs"
    certs.make(certdir, ["meta:etcd", "meta:meta"])
    for endpoint in run_etcd(tmp_path, certdir):
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
            http_metadata=True,  # the Mooncake endpoint is off unless asked for
            backend=backend,
            etcd_endpoints=endpoint or None,
        )
        proc = start_service(f"meta-{len(started)}", args, tmp_path, timeout=60)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
