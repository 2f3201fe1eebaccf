"""What a worker tells meta about itself: the labels it registers once and the load it
reports with every heartbeat."""

from __future__ import annotations

from pdserve.engines.base import Engine
from pdserve.engines.config import EngineConfig
from pdserve.services.worker.slots import SlotLimit
from pdserve.v1 import common_pb2


def registration_labels(cfg: EngineConfig, engine: Engine) -> dict[str, str]:
    """What a worker registers about itself with meta, for the router: its KV fingerprint
    (:meth:`pdserve.hashing.ModelFingerprint.to_labels`: the digest, hex, and every field it
    covers), from which the router keys prompts and refuses workers whose
    chunks its lookups would never find; and its limits, which the router enforces before
    placing a request (``services/router/fingerprint.py``, ``frontend.py``)."""
    fp = engine.fingerprint
    return {
        "engine": cfg.engine,
        **fp.to_labels(),
        "max_model_len": str(engine.max_model_len),
        "max_tokens_limit": str(cfg.resolved_max_tokens_limit(engine.max_model_len)),
        # "on", or why the engine serves without the store (pdserve status shows it)
        "kv_store": f"off: {engine.store_off}"
        if engine.store_off
        else ("on" if cfg.store_master else "none"),
    }


def load_proto(engine: Engine, slots: SlotLimit) -> common_pb2.Load:
    """The load to report: the requests this worker holds (``slots.active``, exact at every
    slot change), split into running and queued as the engine sees them. The engine's own
    counts may lag a request's start or end by a step (they change on its thread), so they
    only split the total, never change it."""
    load = engine.load()
    running = min(load.running_requests, slots.active)
    return common_pb2.Load(
        queue_length=slots.active - running,
        running_requests=running,
        kv_usage=load.kv_usage,
    )
