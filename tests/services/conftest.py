"""Real processes for the worker service tests: a KV store master and one node, torch-engine
prefill and decode workers on the tiny model (chunk_size 16), all stopped by pid. (The vLLM
workers' service tests are tests/vllm_services'.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import CS

from pdserve.procs import (
    ServiceProcess,
    remove_shm,
    service_args,
    start_master,
    start_node,
    start_service,
)


def start_worker(
    role: str, log_dir: Path, master: str, model_dir: Path, *extra: str
) -> ServiceProcess:
    return start_service(
        f"{role}-{uuid.uuid4().hex[:6]}",
        service_args(
            role,
            *extra,
            engine="torch",
            model=model_dir,
            served_model_name="tiny",
            chunk_size=CS,
            max_model_len=512,
            store_master=master,
            port=0,
            metrics_port=0,
        ),
        log_dir,
        timeout=90,
    )


class Stack:
    """A store (master + one node) plus worker processes; ``close`` stops them all."""

    def __init__(self, log_dir: Path, model_dir: Path) -> None:
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.procs: list[ServiceProcess] = []
        self.master = self._add(start_master(log_dir, name="master"))
        self.node = self._add(start_node(self.store_address, log_dir))  # a node id of its own

    def _add(self, proc: ServiceProcess) -> ServiceProcess:
        self.procs.append(proc)
        return proc

    @property
    def store_address(self) -> str:
        return self.master.info["grpc"]

    def worker(self, role: str, *extra: str) -> ServiceProcess:
        return self._add(
            start_worker(role, self.log_dir, self.store_address, self.model_dir, *extra)
        )

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        remove_shm(self.node)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model_dir)
    try:
        yield s
    finally:
        s.close()
