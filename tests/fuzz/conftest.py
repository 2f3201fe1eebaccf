"""Fixtures of the fuzz tests: a KV store (master + one node with a 1 MiB segment) and a meta
as real processes, and an in-process router in front of fake workers (tests/router)."""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tools.fuzz.engine import start_workers
from tools.fuzz.store import STORE_MASTER_FLAGS, StoreTarget

from pdserve import procs

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # router_fakes


@pytest.fixture
def fuzz_cases() -> int:
    """Hypothesis cases per surface: a few dozen in CI (PDSERVE_FUZZ_CASES to change it;
    ``python -m tests.tools.fuzz`` runs thousands)."""
    return int(os.environ.get("PDSERVE_FUZZ_CASES", "60"))


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreTarget]:
    log_dir = tmp_path_factory.mktemp("fuzz-store")
    with procs.local_store(
        log_dir, segment_size="1MiB", transports="tcp", master_flags=STORE_MASTER_FLAGS
    ) as (master, node):
        yield StoreTarget.of(master.info, node.info)


@pytest.fixture(scope="session")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.ServiceProcess]:
    args = procs.service_args("meta", port=0, http_port=0, http_metadata=True, backend="memory")
    proc = procs.start_service("fuzz-meta", args, tmp_path_factory.mktemp("fuzz-meta"), timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def router(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    """(gRPC address, HTTP host:port) of an in-process router in front of a fake prefill and
    a fake decode worker, all on an event loop of their own thread."""
    from router_fakes import FakeDecode, FakePrefill, fake_cluster

    started: queue.Queue = queue.Queue()
    done = threading.Event()

    async def main() -> None:
        workers = [FakePrefill()], [FakeDecode()]
        async with fake_cluster(*workers, tiny_model_dir, max_tokens_limit=64) as (running, _):
            started.put(running)
            while not done.is_set():
                await asyncio.sleep(0.05)

    def serve() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            started.put(exc)

    thread = threading.Thread(target=serve, name="fuzz-router", daemon=True)
    thread.start()
    running = started.get(timeout=60)
    if isinstance(running, BaseException):
        raise running
    try:
        yield f"127.0.0.1:{running.grpc_port}", f"127.0.0.1:{running.http_port}"
    finally:
        done.set()
        thread.join(30)


@pytest.fixture(scope="session")
def workers(store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(prefill, decode) gRPC addresses of torch workers on the tiny model."""
    started = start_workers(tmp_path_factory.mktemp("fuzz-workers"), store.master)
    try:
        yield started[0].info["grpc"], started[1].info["grpc"]
    finally:
        for proc in started:
            proc.stop()
