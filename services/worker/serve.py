"""The serve skeleton of both worker roles: engine, gRPC server with the role's servicer,
/metrics, meta registration with live load, READY line, and the drain on stop."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import grpcutil, identity, lifecycle, telemetry
from pdserve.devices import pin_process
from pdserve.discovery import leave, register_service
from pdserve.engines import create_engine
from pdserve.engines.base import Engine
from pdserve.identity import RequireRole, advertised
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.registration import load_proto, registration_labels
from pdserve.store.client import reads, writes  # noqa: F401 (the store metrics the engine relays)
from pdserve.v1 import meta_pb2

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What distinguishes one worker role from the other."""

    service: str  # "prefill" | "decode"
    role: int  # common_pb2.Role
    #: (add_XServicer_to_server, full gRPC service name)
    add_servicer: Callable[[Any, Any], None]
    grpc_name: str
    #: Builds the servicer; it holds its :class:`~pdserve.services.worker.slots.SlotLimit`
    #: as ``slots``.
    make_servicer: Callable[[Engine, WorkerConfig], Any]


def default_instance_id(service: str) -> str:
    """The id a worker registers when none is given: with TLS its certificate's name (meta
    takes a worker's registration only under that name, :mod:`pdserve.services.meta.access`),
    or ``<name>-<random>`` for a pool's shared certificate (``worker:decode``); without TLS
    ``<service>-<random>``."""
    files = identity.tls()
    name = files.identity().name if files is not None else service
    return name if name != service else f"{name}-{uuid.uuid4().hex[:8]}"


async def serve(spec: WorkerSpec, cfg: WorkerConfig, stop: asyncio.Event) -> None:
    """Runs one worker until ``stop`` is set, then drains: health NOT_SERVING and deregister
    first (no new work is routed here), wait up to ``drain_timeout_s`` for in-flight RPCs,
    then close the engine (and with it its store clients)."""
    if cfg.vllm_cpu_cores and cfg.engine != "torch":
        # the worker, vLLM's engine core and its model process on the worker's cores
        pin_process(cfg.vllm_cpu_cores)
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
        instance_id = cfg.instance_id or default_instance_id(spec.service)
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
            load_fn=lambda: load_proto(engine, servicer.slots),
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
