"""One cluster for every vLLM service test here: meta, a KV store (master + one node), one vLLM
prefill worker and one vLLM decode worker (one core each; the tiny model, KV in float32, chunk
64 = two vLLM blocks of 32) and the router, every internal link mutual TLS as under
``pdserve up``. Started once for the package (a vLLM engine takes tens of seconds to start on
2 cores; tests/conftest.py keeps these files on one test worker) and stopped when its last
test is done."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from cluster_harness import Cluster

from vllm_services.vllm_flags import CHUNK, VLLM


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path_factory.mktemp("vllm-cluster"),
        tiny_model_dir,
        prefills=1,
        # two vLLM CPU engines on a 2-core machine: one core each
        worker_flags=lambda role, i: {**VLLM, "vllm_cpu_cores": "0" if role == "prefill" else "1"},
        router_flags={"chunk_size": CHUNK},
        node_id=f"n0-vllm-{os.getpid()}",
        tls=True,
    )
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def vllm_workers(cluster: Cluster):
    """The cluster's (vLLM prefill worker, vLLM decode worker), called directly."""
    return cluster.prefills[0], cluster.decode
