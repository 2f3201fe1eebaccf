"""Shared fixtures for the store tests: a KV store master and storage nodes as real processes
(``pdserve kvstore master`` / ``pdserve kvstore node``), stopped by pid afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.procs import ServiceProcess, start_service
from pdserve.store.mooncake_backend import MooncakeCluster

SHM = Path("/dev/shm")


def start_master(log_dir: Path, *extra: str) -> ServiceProcess:
    return start_service(
        f"master-{uuid.uuid4().hex[:6]}",
        ["kvstore", "master", "--port", "0", "--metrics-port", "-1", *extra],
        log_dir,
        timeout=60,
    )


def start_node(
    master: ServiceProcess,
    log_dir: Path,
    *,
    node_id: str | None = None,
    segments: str = "64MiB",
    transports: str = "shm,tcp",
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> ServiceProcess:
    node_id = node_id or f"n{uuid.uuid4().hex[:8]}"
    return start_service(
        node_id,
        [
            "kvstore",
            "node",
            "--master-address",
            master.info["grpc"],
            "--node-id",
            node_id,
            "--segment-sizes",
            segments,
            "--transports",
            transports,
            *(extra or []),
        ],
        log_dir,
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1", **(env or {})},
        timeout=60,
    )


def shm_leftovers(node: ServiceProcess) -> list[str]:
    return [n for n in node.info.get("shm_names", []) if (SHM / n).exists()]


def remove_shm(node: ServiceProcess) -> None:
    """Cleanup after a SIGKILLed node (a clean node unlinks its own files)."""
    for n in node.info.get("shm_names", []):
        (SHM / n).unlink(missing_ok=True)


class Cluster:
    """A master plus nodes; everything started here is stopped at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.master = start_master(log_dir)
        self.nodes: list[ServiceProcess] = []

    @property
    def address(self) -> str:
        return self.master.info["grpc"]

    def add_node(self, **kwargs) -> ServiceProcess:
        node = start_node(self.master, self.log_dir, **kwargs)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
            remove_shm(node)
        self.master.stop()


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[[], Cluster]]:
    made: list[Cluster] = []

    def make() -> Cluster:
        c = Cluster(tmp_path / f"logs{len(made)}")
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One master and two nodes serving shm, tcp and (when installed) mooncake."""
    from pdserve.store.transports.mooncake import available

    c = Cluster(tmp_path_factory.mktemp("cluster"))
    transports = "shm,tcp,mooncake" if available() else "shm,tcp"
    try:
        c.add_node(transports=transports)
        c.add_node(transports=transports)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """A Mooncake Store cluster; skipped with the reason when mooncake does not import."""
    from pdserve.store.mooncake_backend import available

    if not available():
        pytest.skip("mooncake-transfer-engine is not installed (mooncake.store does not import)")
    c = MooncakeCluster.start(tmp_path_factory.mktemp("mooncake"), "128MiB", lease_ms=500)
    yield c
    c.stop()


@pytest.fixture
def kvprocs():
    """The process helpers of this conftest, for tests that start masters and nodes by hand
    (test modules cannot import a conftest reliably)."""
    import types

    return types.SimpleNamespace(
        start_master=start_master, start_node=start_node, shm_leftovers=shm_leftovers
    )
