"""``pdserve meta``: the registry over gRPC plus an HTTP port (Prometheus service discovery, and
the Mooncake HTTP metadata endpoint when ``http_metadata`` asks for it), one process, one event
loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve import identity, lifecycle, telemetry
from pdserve.auth import load_key
from pdserve.config import ConfigError, help_field
from pdserve.enums import ROLE
from pdserve.etcdaccess import EtcdAccess
from pdserve.identity import SecurityConfig, advertised
from pdserve.services.meta import http_metadata, prometheus_sd
from pdserve.services.meta.backends.base import Backend
from pdserve.services.meta.caps import DEFAULT_ROLE_BOUNDS, Limits
from pdserve.services.meta.registry import TTL_MAX_MS, TTL_MIN_MS, Registry

log = logging.getLogger(__name__)

#: Default gRPC port of the meta service (the registry every other service points at).
DEFAULT_PORT = 50050
#: Default port of the Mooncake-compatible HTTP metadata endpoint.
DEFAULT_HTTP_PORT = 50080


@dataclass
class MetaConfig(SecurityConfig, telemetry.MetricsConfig):
    host: str = help_field("127.0.0.1", "address to bind gRPC and HTTP to")
    port: int = help_field(DEFAULT_PORT, "gRPC port (0 = a free port)")
    http_port: int = help_field(
        DEFAULT_HTTP_PORT,
        "HTTP port: Prometheus service discovery of every service's /metrics at "
        "/prometheus/targets, and Mooncake metadata at /metadata with http_metadata (0 = a free "
        "port, -1 = off)",
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
    etcd_ca: str = help_field(
        "", "CA certificate (PEM) of etcd's server certificate: connect to etcd over TLS"
    )
    etcd_cert: str = help_field(
        "", "client certificate (PEM) for an etcd that requires one (with etcd_key and etcd_ca)"
    )
    etcd_key: str = help_field("", "private key (PEM) of etcd_cert")
    etcd_server_name: str = help_field(
        "",
        "host name to check in etcd's server certificates; needed over TLS with several "
        "etcd endpoints (empty = each endpoint's own host)",
    )
    etcd_user: str = help_field("", "etcd user to authenticate as (etcd auth enabled)")
    etcd_password: str = help_field("", "password of etcd_user (prefer etcd_password_file)")
    etcd_password_file: str = help_field("", "file whose first line is the password of etcd_user")
    min_ttl_ms: int = help_field(TTL_MIN_MS, "shortest lease a client may ask for (ms)")
    max_ttl_ms: int = help_field(TTL_MAX_MS, "longest lease a client may ask for (ms)")
    max_instances: int = help_field(
        Limits.max_instances,
        "most live instances meta holds; more registrations are refused",
        metavar="N",
    )
    max_instances_per_identity: int = help_field(
        Limits.max_instances_per_identity,
        "most live instances one TLS identity (certificate) may register (no cap without TLS)",
        metavar="N",
    )
    max_instances_per_identity_by_role: dict[str, int] = help_field(
        DEFAULT_ROLE_BOUNDS,
        "role -> most live instances of that role one TLS identity may register (0 = no bound "
        "of its own; a role not named has none): one prefill or decode instance per worker "
        "certificate by default, so a worker cannot register a second instance and take a "
        "second share of the requests; a re-registration of the same instance_id always fits. "
        "It does not count a pool's shared certificate (worker:decode) nor admin (JSON on a "
        "flag)",
        metavar="JSON",
    )
    max_labels: int = help_field(Limits.max_labels, "most labels on one instance")
    max_label_bytes: int = help_field(
        Limits.max_label_bytes, "longest label key, and longest label value (bytes, UTF-8)"
    )
    max_record_bytes: int = help_field(
        Limits.max_record_bytes,
        "largest instance record as registered (bytes, serialized); bounds list pages",
    )
    http_token: str = help_field(
        "",
        "token every request to the Mooncake HTTP metadata endpoint must carry "
        "(Authorization: Bearer, or the password of Basic credentials, as in "
        "http://pdserve:TOKEN@host:port/metadata; empty = open; prefer http_token_file)",
    )
    http_token_file: str = help_field("", "file whose first line is http_token")
    http_max_keys: int = help_field(
        http_metadata.MAX_KEYS, "most keys the Mooncake HTTP metadata endpoint stores"
    )
    http_max_value_bytes: int = help_field(
        http_metadata.MAX_VALUE_BYTES, "largest value one PUT may store (bytes)"
    )
    http_max_total_bytes: int = help_field(
        http_metadata.MAX_TOTAL_BYTES,
        "most bytes the Mooncake HTTP metadata endpoint stores, every value together",
    )
    # after the fields above: in the class body this name hides the module
    http_metadata: bool = help_field(
        False,
        "serve Mooncake's HTTP metadata protocol at /metadata on http_port, for Transfer "
        "Engines whose metadata_server is http://host:port/metadata (pdserve's own store never "
        "needs it). Beyond loopback it needs http_token, unless http_metadata_open",
    )
    http_metadata_open: bool = help_field(
        False,
        "serve /metadata on a non-loopback address without http_token: anyone who reaches the "
        "port can read the Transfer Engines' segment descriptors and publish their own",
    )
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
        try:
            self.limits().validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if min(self.http_max_keys, self.http_max_value_bytes, self.http_max_total_bytes) <= 0:
            raise ConfigError(
                "http_max_keys, http_max_value_bytes and http_max_total_bytes must be positive"
            )
        self.http_token = load_key(self.http_token, self.http_token_file, name="http_token")
        self.http_token_file = ""
        self.etcd_password = load_key(
            self.etcd_password, self.etcd_password_file, name="etcd_password"
        )
        self.etcd_password_file = ""
        self.etcd_access().check()
        self._check_metadata_exposure()

    def etcd_access(self) -> EtcdAccess:
        return EtcdAccess(
            tuple(self.etcd_endpoints),
            ca=self.etcd_ca,
            cert=self.etcd_cert,
            key=self.etcd_key,
            server_name=self.etcd_server_name,
            user=self.etcd_user,
            password=self.etcd_password,
        )

    def _check_metadata_exposure(self) -> None:
        """Protected mode for the Mooncake endpoint (:mod:`.http_metadata`), as
        :func:`pdserve.identity.check_exposure` for the gRPC ports: beyond loopback it takes
        the token, unless explicitly opened."""
        if (
            not self.http_metadata
            or self.http_port < 0
            or self.http_token
            or self.http_metadata_open
            or identity.is_loopback(self.host)  # check_exposure's rule for gRPC ports
            or (self.insecure and not self.tls_cert)  # a plaintext cluster, open by choice
        ):
            return
        raise ConfigError(
            f"meta's Mooncake HTTP metadata endpoint would listen on {self.host!r}, reachable "
            "from other hosts, without http_token (or http_token_file; Transfer Engines send it "
            "in the URL, http://pdserve:TOKEN@host:port/metadata): anyone who reaches it could "
            "read the engines' segment descriptors, fill meta's memory, or publish a segment "
            "that redirects their transfers. Bind 127.0.0.1, set the token, turn it off "
            "(--no-http-metadata), or pass --http-metadata-open to accept the risk"
        )

    def limits(self) -> Limits:
        return Limits(
            max_instances=self.max_instances,
            max_instances_per_identity=self.max_instances_per_identity,
            max_instances_per_identity_by_role=dict(self.max_instances_per_identity_by_role),
            max_labels=self.max_labels,
            max_label_bytes=self.max_label_bytes,
            max_record_bytes=self.max_record_bytes,
        )


def make_backend(cfg: MetaConfig) -> Backend:
    if cfg.backend == "etcd":
        from pdserve.services.meta.backends.etcd import EtcdBackend

        return EtcdBackend(cfg.etcd_access())
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
        for number in ROLE.specified:
            instances.add_metric([ROLE.proto_names[number]], counts[number])
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
    from pdserve.services.meta.servicer import MetaServicer
    from pdserve.v1 import meta_pb2, meta_pb2_grpc

    backend = make_backend(cfg)
    registry = Registry(
        backend, min_ttl_ms=cfg.min_ttl_ms, max_ttl_ms=cfg.max_ttl_ms, limits=cfg.limits()
    )
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
    tls = identity.tls()
    metrics_port = telemetry.serve_metrics(cfg.metrics_port, cfg.host)
    if cfg.http_port >= 0:
        if cfg.http_metadata:
            app = http_metadata.make_app(
                backend,
                token=cfg.http_token,
                max_keys=cfg.http_max_keys,
                max_value_bytes=cfg.http_max_value_bytes,
                max_total_bytes=cfg.http_max_total_bytes,
            )
        else:
            from aiohttp import web

            app = web.Application()
        own = advertised(cfg, metrics_port) if metrics_port else ""
        prometheus_sd.add_route(app, registry, own_metrics=own)
        ssl_context = http_metadata.ssl_context(tls) if tls is not None else None
        runner, http_port = await http_metadata.start(app, cfg.host, cfg.http_port, ssl_context)
    scheme = "https" if tls is not None else "http"
    # http: the Mooncake metadata URL when it is served, else the port's root
    path = http_metadata.PATH if cfg.http_metadata else ""
    lifecycle.announce_ready(
        "meta",
        grpc=f"{cfg.host}:{server.port}",
        http=f"{scheme}://{cfg.host}:{http_port}{path}" if runner else "",
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
