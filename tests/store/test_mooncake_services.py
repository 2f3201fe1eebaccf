"""``--store-backend mooncake`` end to end on real processes: a real Mooncake Store
(``mooncake_master`` plus a process contributing its segment), meta, a torch prefill and a
torch decode worker on the tiny model and the router, every one of them reaching the KV cache
through Mooncake only (no pdserve store runs). Greedy output must equal the single-process
Hugging Face run token for token, and a repeated prompt must load its chunks from Mooncake."""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from router_traces import read_router_traces
from transformers import AutoTokenizer

from pdserve import grpcutil
from pdserve.procs import ServiceProcess, service_args, start_service
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]
CS = 16
LOCAL = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


class MooncakeServices:
    def __init__(self, log_dir: Path, model_dir: Path, mooncake_address: str) -> None:
        self.log_dir = log_dir
        self.procs: list[ServiceProcess] = []
        try:
            self._start(model_dir, mooncake_address)
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, args: list[str]) -> ServiceProcess:
        proc = start_service(name, args, self.log_dir, timeout=120, env=LOCAL)
        self.procs.append(proc)
        return proc

    def _start(self, model_dir: Path, mooncake: str) -> None:
        meta = self._add("meta", service_args("meta", port=0, http_port=-1)).info["grpc"]
        store = {"store_backend": "mooncake", "store_master": mooncake}
        common = dict(
            engine="torch",
            model=model_dir,
            served_model_name="tiny",
            chunk_size=CS,
            max_model_len=2048,
            meta=meta,
            port=0,
            metrics_port=0,
            **store,
        )
        self.prefill = self._add("prefill", service_args("prefill", **common))
        self.decode = self._add("decode", service_args("decode", **common))
        self.router = self._add(
            "router",
            service_args(
                "router",
                model=model_dir,
                served_name="tiny",
                chunk_size=CS,
                max_model_len=2048,
                port=0,
                http_port=-1,
                meta=meta,
                policy="cache_aware",
                local_prefill_threshold=0,
                **store,
            ),
        )
        self.grpc = self.router.info["grpc"]
        with grpcutil.sync_channel(self.grpc, public=True) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                (m,) = stub.ListModels(router_pb2.ListModelsRequest()).models
                if m.prefill_workers == 1 and m.decode_workers == 1:
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"router did not discover the workers: {m}")

    def stream(self, **kw) -> list[router_pb2.GenerateStreamResponse]:
        with grpcutil.sync_channel(self.grpc) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            return list(stub.GenerateStream(router_pb2.GenerateRequest(**kw), timeout=120))

    def traces(self, *wait_for: str) -> dict[str, dict]:
        """The router's per-request trace lines, by request id (waiting for ``wait_for``)."""
        return read_router_traces(self.router.log_path, *wait_for)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def metric(proc: ServiceProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://{proc.info['metrics']}/metrics", timeout=5).read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model_dir, mooncake_cluster) -> Iterator[MooncakeServices]:
    c = MooncakeServices(
        tmp_path_factory.mktemp("mooncake-services"), tiny_model_dir, mooncake_cluster.address
    )
    try:
        yield c
    finally:
        c.close()


def test_prefill_decode_router_on_mooncake_store_are_token_exact(
    services, mooncake_cluster, tiny_model_dir, hf_greedy
):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    salt = uuid.uuid4().hex[:8]
    text = f"{salt} a lighthouse keeper counts the ships that pass the rocks at night " * 3
    prompt = tok.encode(text)
    assert len(prompt) > 2 * CS
    full = min(len(prompt) // CS * CS, len(prompt) - 1) // CS * CS  # chunks the store can hold
    want = hf_greedy(prompt, 16)
    greedy = common_pb2.SamplingParams(max_tokens=16, temperature=0.0)
    cached_metric = 'pdserve_prefill_prompt_tokens_total{source="cached"}'
    before = metric(services.prefill, cached_metric)

    first = services.stream(prompt_token_ids=prompt, sampling=greedy, request_id=f"a-{salt}")
    assert [t for m in first for t in m.token_ids] == want
    assert first[0].cached_tokens == 0
    assert metric(services.prefill, cached_metric) == before

    # the chunks prefill wrote are in the Mooncake Store: the router's Mooncake lookup finds
    # them, prefill loads them from there instead of computing them, decode loads the whole KV
    second = services.stream(prompt_token_ids=prompt, sampling=greedy, request_id=f"b-{salt}")
    assert [t for m in second for t in m.token_ids] == want
    assert second[0].cached_tokens == full
    assert metric(services.prefill, cached_metric) - before == full
    traces = services.traces(f"a-{salt}", f"b-{salt}")
    for rid in (f"a-{salt}", f"b-{salt}"):
        tr = traces[rid]
        assert tr["outcome"] == "ok", tr
        assert (tr["decode_loaded"], tr["decode_recomputed"]) == (len(prompt), 0), tr
