"""services/worker/registration.py: the load a worker reports (no process), and a decode worker
that registers with a real meta process, reports load, and deregisters when it drains on
SIGTERM. No store: it recomputes (and says so in its metrics)."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve import grpcutil
from pdserve.model.fingerprint import model_fingerprint
from pdserve.procs import service_args, start_service
from pdserve.services.worker.registration import load_proto
from pdserve.services.worker.slots import SlotLimit
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, meta_pb2, meta_pb2_grpc


def test_reported_load_is_the_slots_split_by_the_engine() -> None:
    def engine(running: int, queued: int):
        load = SimpleNamespace(running_requests=running, queue_length=queued, kv_usage=0.5)
        return SimpleNamespace(load=lambda: load)

    slots = SlotLimit(8, "max_queue")
    slots.active = 3
    load = load_proto(engine(2, 0), slots)  # the engine has not queued the third one yet
    assert (load.running_requests, load.queue_length, load.kv_usage) == (2, 1, 0.5)
    slots.active = 0
    load = load_proto(engine(1, 0), slots)  # the engine frees its slot a step later
    assert (load.running_requests, load.queue_length) == (0, 0)


@pytest.mark.slow
def test_register_serve_without_store_and_deregister(tmp_path: Path, tiny_model_dir: Path) -> None:
    meta = start_service(
        "meta", service_args("meta", port=0, http_port=0, metrics_port=-1), tmp_path, timeout=60
    )
    worker = None
    try:
        worker = start_service(
            "decode",
            service_args(
                "decode",
                engine="torch",
                model=tiny_model_dir,
                served_model_name="tiny",
                chunk_size=16,
                meta=meta.info["grpc"],
                instance_id="decode-test",
                port=0,
                metrics_port=0,
            ),
            tmp_path,
            timeout=90,
        )
        with grpcutil.sync_channel(meta.info["grpc"]) as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            listed = stub.ListInstances(
                meta_pb2.ListInstancesRequest(role=common_pb2.ROLE_DECODE)
            ).instances
            assert [(i.instance_id, i.address, i.model) for i in listed] == [
                ("decode-test", worker.info["grpc"], "tiny")
            ]
            assert listed[0].labels["metrics"] == worker.info["metrics"]
            # its KV fingerprint (digest and fields) and limits, for the router to check
            fp = model_fingerprint(tiny_model_dir, "tiny", "float32", 16)
            assert {k: v for k, v in listed[0].labels.items() if k != "metrics"} == {
                "engine": "torch",
                "fingerprint": fp.digest().hex(),
                "model_id": "tiny",
                "model_revision": fp.revision,
                "kv_dtype": "float32",
                "chunk_size": "16",
                "kv_compression": "none",
                "kv_layout": str(fp.layout_version),
                "tp": "0/1",
                "max_model_len": "4096",
                "max_tokens_limit": "4096",
                "kv_store": "none",  # started without a store master
            }
            # serves without a store: local prefill, every prompt token recomputed
            with grpcutil.sync_channel(worker.info["grpc"]) as wch:
                msgs = list(
                    engine_pb2_grpc.DecodeServiceStub(wch).Decode(
                        engine_pb2.DecodeRequest(
                            model="tiny",
                            prompt_token_ids=list(range(10, 30)),
                            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
                        ),
                        timeout=30,
                    )
                )
            assert (msgs[-1].loaded_tokens, msgs[-1].recomputed_tokens) == (0, 20)
            text = (
                urllib.request.urlopen(f"http://{worker.info['metrics']}/metrics", timeout=5)
                .read()
                .decode()
            )
            assert 'pdserve_kv_computed_tokens_total{reason="local"} 20.0' in text
            assert worker.stop() == 0
            listed = stub.ListInstances(
                meta_pb2.ListInstancesRequest(role=common_pb2.ROLE_DECODE)
            ).instances
            assert list(listed) == []
    finally:
        if worker is not None:
            worker.stop()
        meta.stop()
