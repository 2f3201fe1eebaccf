"""What the prefill and decode services share: their config fields, proto mapping, a slot
limit, and the serve skeleton (store client, engine, gRPC server, /metrics, meta registration
with live load, READY line, drain on stop). Request ids and model names are checked by
:mod:`pdserve.validation`, the same rules as the router's.

Each service adds only its servicer (``services/prefill``, ``services/decode``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdserve import grpcutil, lifecycle, telemetry
from pdserve.config import ConfigError, help_field
from pdserve.discovery import leave, register_service
from pdserve.engines import create_engine
from pdserve.engines.base import Engine, KVRef, Sampling
from pdserve.engines.config import EngineConfig
from pdserve.errors import ResourceExhausted
from pdserve.identity import RequireRole, SecurityConfig, advertised
from pdserve.v1 import common_pb2, meta_pb2

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig(SecurityConfig, EngineConfig):
    """Engine fields plus what every model worker service needs."""

    host: str = help_field("127.0.0.1", "address to bind and advertise")
    port: int = help_field(0, "gRPC port (0 = a free port, printed in the READY line)")
    metrics_port: int = help_field(0, "Prometheus /metrics port (0 = free port, -1 = off)")
    meta: str = help_field("", "meta service address host:port to register with (empty = none)")
    instance_id: str = help_field("", "id registered with meta (empty = <role>-<random>)")
    max_queue: int = help_field(
        64, "requests accepted at once beyond the running ones; more get RESOURCE_EXHAUSTED"
    )
    heartbeat_ttl_ms: int = help_field(6000, "meta lease TTL (milliseconds); heartbeats at 1/3")
    drain_timeout_s: float = help_field(
        30.0, "on SIGTERM, how long in-flight requests may finish (seconds)"
    )
    log_level: str = help_field("info", "log level: debug|info|warning|error")

    def validate(self) -> None:
        super().validate()
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


# --------------------------------------------------------------------- proto mapping


def sampling_from_proto(
    p: common_pb2.SamplingParams, engine: Engine, cfg: EngineConfig, prompt_len: int
) -> Sampling:
    """Applies the documented defaults; max_tokens 0 = as many as the limit and context allow.
    The engine validates the result (INVALID_ARGUMENT naming the field)."""
    max_tokens = p.max_tokens or max(
        1,
        min(cfg.resolved_max_tokens_limit(engine.max_model_len), engine.max_model_len - prompt_len),
    )
    return Sampling(
        max_tokens=max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        json_object=p.json_object,
        json_schema=p.json_schema,
    )


def kvref_from_proto(h: common_pb2.KVHandle) -> KVRef:
    return KVRef(
        chunk_keys=tuple(h.chunk_keys),
        tail_key=h.tail_key,
        num_tokens=h.num_tokens,
        chunk_size=h.chunk_size,
        fingerprint=bytes(h.fingerprint),
    )


def kvref_to_proto(kv: KVRef) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        chunk_keys=list(kv.chunk_keys),
        tail_key=kv.tail_key,
        num_tokens=kv.num_tokens,
        chunk_size=kv.chunk_size,
        fingerprint=kv.fingerprint,
    )


class SlotLimit:
    """Caps the requests a worker holds at once (running + waiting); beyond it,
    RESOURCE_EXHAUSTED naming the limit. ``changed`` is set whenever a request takes or frees
    a slot: the meta heartbeat waits on it to report the new load at once."""

    def __init__(self, limit: int, limit_name: str) -> None:
        self.limit = limit
        self.limit_name = limit_name
        self.active = 0
        self.changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.active >= self.limit:
            raise ResourceExhausted(
                f"worker is full: {self.active} requests in flight ({self.limit_name} = {self.limit})"
            )
        self.active += 1
        self.changed.set()
        try:
            yield
        finally:
            self.active -= 1
            self.changed.set()


# --------------------------------------------------------------------- serving


@dataclass
class WorkerSpec:
    """What distinguishes one worker service from another."""

    service: str  # "prefill" | "decode"
    role: int  # common_pb2.Role
    #: (add_XServicer_to_server, full gRPC service name)
    add_servicer: Callable[[Any, Any], None]
    grpc_name: str
    #: Builds the servicer; it holds its :class:`SlotLimit` as ``slots``.
    make_servicer: Callable[[Engine, WorkerConfig], Any]


async def serve(spec: WorkerSpec, cfg: WorkerConfig, stop: asyncio.Event) -> None:
    """Runs one worker until ``stop`` is set, then drains: health NOT_SERVING and deregister
    first (no new work is routed here), wait up to ``drain_timeout_s`` for in-flight RPCs,
    then close the engine (and with it its store clients)."""
    engine = create_engine(cfg)
    meta_client = None
    server = None
    try:
        await engine.start()
        servicer = spec.make_servicer(engine, cfg)
        server = await grpcutil.start_server(
            [(spec.add_servicer, servicer, spec.grpc_name)],
            f"{cfg.host}:{cfg.port}",
            # with mutual TLS, only the router (and admins) place work on a worker
            interceptors=[RequireRole(("router",), f"call a {spec.service} worker")],
        )
        address = advertised(cfg, server.port)
        metrics_port = telemetry.serve_metrics(cfg.metrics_port, cfg.host)
        instance_id = cfg.instance_id or f"{spec.service}-{uuid.uuid4().hex[:8]}"
        labels = registration_labels(cfg, engine)
        if metrics_port:
            labels["metrics"] = advertised(cfg, metrics_port)
        meta_client = await register_service(
            cfg.meta,
            meta_pb2.Instance(
                instance_id=instance_id,
                role=spec.role,
                address=address,
                model=cfg.served_name(),
                max_running=cfg.resolved_max_num_seqs(),
                labels=labels,
            ),
            ttl_ms=cfg.heartbeat_ttl_ms,
            load_fn=lambda: _load_proto(engine, servicer.slots),
            load_changed=servicer.slots.changed,
        )
        lifecycle.announce_ready(
            spec.service,
            grpc=address,
            metrics=f"{cfg.host}:{metrics_port}" if metrics_port else "",
            instance_id=instance_id,
            model=cfg.served_name(),
            engine=cfg.engine,
            pid=os.getpid(),
        )
        log.info("%s %s serving %s on %s", spec.service, instance_id, cfg.served_name(), address)
        await stop.wait()
        log.info("%s %s draining", spec.service, instance_id)
        server.set_serving(False)
        await leave(meta_client)  # first, so routers stop sending work here
        meta_client = None
    finally:
        if server is not None:
            await server.stop(cfg.drain_timeout_s)
        await leave(meta_client)
        await engine.close()


def registration_labels(cfg: EngineConfig, engine: Engine) -> dict[str, str]:
    """What a worker registers about itself with meta, for the router: its KV fingerprint
    (the digest, hex, and the fields it covers besides the model name, which is the
    instance's ``model``), from which the router keys prompts and refuses workers whose
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


def _load_proto(engine: Engine, slots: SlotLimit) -> common_pb2.Load:
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
