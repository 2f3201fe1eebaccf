"""``pdserve meta``: the registry over gRPC plus the Mooncake HTTP metadata endpoint, one
process, one event loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve import lifecycle, telemetry
from pdserve.config import ConfigError, help_field
from pdserve.identity import SecurityConfig
from pdserve.services.meta.backends.base import Backend
from pdserve.services.meta.registry import ROLE_NAMES, TTL_MAX_MS, TTL_MIN_MS, Registry

log = logging.getLogger(__name__)

#: Default gRPC port of the meta service (the registry every other service points at).
DEFAULT_PORT = 50050
#: Default port of the Mooncake-compatible HTTP metadata endpoint.
DEFAULT_HTTP_PORT = 50080


@dataclass
class MetaConfig(SecurityConfig):
    host: str = help_field("127.0.0.1", "address to bind gRPC and HTTP to")
    port: int = help_field(DEFAULT_PORT, "gRPC port (0 = a free port)")
    http_port: int = help_field(
        DEFAULT_HTTP_PORT,
        "Mooncake HTTP metadata port, served at /metadata (0 = a free port, -1 = off)",
    )
    metrics_port: int = help_field(-1, "Prometheus /metrics port (0 = a free port, -1 = off)")
    backend: str = help_field("memory", "registry storage: memory (embedded) or etcd")
    etcd_endpoints: list[str] = field(
        default_factory=lambda: ["127.0.0.1:2379"],
        metadata={
            "help": "etcd host:port list, comma separated (backend=etcd)",
            "metavar": "HOST:PORT,...",
        },
    )
    min_ttl_ms: int = help_field(TTL_MIN_MS, "shortest lease a client may ask for (ms)")
    max_ttl_ms: int = help_field(TTL_MAX_MS, "longest lease a client may ask for (ms)")
    log_level: str = help_field("info", "log level")

    def validate(self) -> None:
        if self.backend not in ("memory", "etcd"):
            raise ConfigError(f"meta backend must be 'memory' or 'etcd', got {self.backend!r}")
        if not TTL_MIN_MS <= self.min_ttl_ms <= self.max_ttl_ms <= TTL_MAX_MS:
            raise ConfigError(
                f"need {TTL_MIN_MS} <= min_ttl_ms <= max_ttl_ms <= {TTL_MAX_MS} "
                f"(got {self.min_ttl_ms}, {self.max_ttl_ms})"
            )
        if self.backend == "etcd" and not self.etcd_endpoints:
            raise ConfigError("backend=etcd needs --etcd-endpoints")


def make_backend(cfg: MetaConfig) -> Backend:
    if cfg.backend == "etcd":
        from pdserve.services.meta.backends.etcd import EtcdBackend

        return EtcdBackend(cfg.etcd_endpoints)
    from pdserve.services.meta.backends.memory import MemoryBackend

    return MemoryBackend()


class _MetaCollector:
    """Exports the registry's live figures at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        counts = self.registry.count_by_role()
        instances = GaugeMetricFamily(
            "pdserve_meta_instances", "Registered instances by role", labels=["role"]
        )
        for number, name in ROLE_NAMES.items():
            instances.add_metric([name], counts[number])
        yield instances
        yield CounterMetricFamily(
            "pdserve_meta_heartbeats",
            "Heartbeats accepted since start",
            value=self.registry.heartbeats,
        )
        yield GaugeMetricFamily(
            "pdserve_meta_watch_subscribers",
            "Open WatchInstances streams",
            value=self.registry.subscribers,
        )


async def serve(cfg: MetaConfig, stop: asyncio.Event) -> None:
    from pdserve import grpcutil
    from pdserve.services.meta import http_metadata
    from pdserve.services.meta.servicer import MetaServicer
    from pdserve.v1 import meta_pb2, meta_pb2_grpc

    backend = make_backend(cfg)
    registry = Registry(backend, min_ttl_ms=cfg.min_ttl_ms, max_ttl_ms=cfg.max_ttl_ms)
    await registry.start()
    telemetry.REGISTRY.register(_MetaCollector(registry))
    server = await grpcutil.start_server(
        [
            (
                meta_pb2_grpc.add_MetaServiceServicer_to_server,
                MetaServicer(registry),
                meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name,
            )
        ],
        f"{cfg.host}:{cfg.port}",
    )
    runner, http_port = None, 0
    if cfg.http_port >= 0:
        runner, http_port = await http_metadata.start(backend, cfg.host, cfg.http_port)
    metrics_port = telemetry.serve_metrics(cfg.metrics_port, cfg.host)
    lifecycle.announce_ready(
        "meta",
        grpc=f"{cfg.host}:{server.port}",
        http=f"http://{cfg.host}:{http_port}{http_metadata.PATH}" if runner else "",
        metrics=metrics_port,
        backend=cfg.backend,
    )
    log.info("meta serving gRPC on %s:%d, backend %s", cfg.host, server.port, cfg.backend)
    await stop.wait()
    log.info("meta draining")
    await registry.close()  # ends watch streams first so the gRPC stop does not wait on them
    await server.stop(grace=2.0)
    if runner is not None:
        await runner.cleanup()
