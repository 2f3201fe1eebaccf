"""The model workers' surface: PrefillService and DecodeService of real torch workers on the
tiny model (:func:`start_workers`, :class:`Engine`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.v1 import common_pb2, engine_pb2

from .grpc_surface import Bases, GrpcSurface

#: Flags of the fuzzed workers: the tiny model, and max_tokens capped so that a valid case
#: generates a few tokens, not thousands.
WORKER_FLAGS = {
    "engine": "torch",
    "served_model_name": "tiny",
    "chunk_size": 16,
    "max_model_len": 512,
    "max_tokens_limit": 16,
    "port": 0,
    "metrics_port": -1,
}


def start_workers(log_dir: Path, master: str) -> list[Any]:
    """A torch prefill and a torch decode worker on the tiny model with the KV store at
    ``master``, started at once; READY (procs.ServiceProcess), the caller stops them."""
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import service_args, spawn_service, wait_ready

    model = build_tiny_model()
    started = [
        spawn_service(
            f"fuzz-{role}",
            service_args(role, model=model, store_master=master, **WORKER_FLAGS),
            log_dir,
        )
        for role in ("prefill", "decode")
    ]
    try:
        for proc in started:
            wait_ready(proc)
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    return started


def _engine_bases(model: str) -> Bases:
    chunk = WORKER_FLAGS["chunk_size"]
    sampling = common_pb2.SamplingParams(max_tokens=2)

    def prompt(k: int) -> list[int]:
        return [(7 * i + k) % 500 + 1 for i in range(chunk + 4 + k)]

    def decode(k: int) -> engine_pb2.DecodeRequest:
        request = engine_pb2.DecodeRequest(
            request_id=f"fz-{k}", model=model, prompt_token_ids=prompt(k), sampling=sampling
        )
        if k % 2:  # a handle to chunks nobody stored: the worker recomputes them
            request.kv.CopyFrom(
                common_pb2.KVHandle(
                    chunk_keys=[f"{k:064x}"],
                    tail_key=f"fz-tail-{k}",
                    num_tokens=len(request.prompt_token_ids),
                    chunk_size=chunk,
                    fingerprint=bytes(32),
                )
            )
            request.first_token_id = 5
        return request

    return {
        "PrefillService.Prefill": lambda k: engine_pb2.PrefillRequest(
            request_id=f"fz-{k}",
            model=model,
            prompt_token_ids=prompt(k),
            sampling=sampling,
            publish_incrementally=k % 2 == 1,
        ),
        "DecodeService.Decode": decode,
    }


class Engine(GrpcSurface):
    """A prefill worker's PrefillService and a decode worker's DecodeService."""

    name = "engine"

    def __init__(self, prefill: str, decode: str, model: str) -> None:
        routes = {
            **self.route(prefill, [engine_pb2.DESCRIPTOR.services_by_name["PrefillService"]]),
            **self.route(decode, [engine_pb2.DESCRIPTOR.services_by_name["DecodeService"]]),
        }
        super().__init__(routes, _engine_bases(model), "DecodeService.Decode")
