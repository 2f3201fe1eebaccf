"""Router process: gRPC RouterService and the OpenAI HTTP API (with /metrics) in one loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pdserve import grpcutil, lifecycle
from pdserve.auth import KeyFailures, RequireKey
from pdserve.discovery import leave, register_service
from pdserve.http_edge import EdgeLimits, EdgeSite
from pdserve.identity import advertised, is_loopback
from pdserve.model.fingerprint import model_revision
from pdserve.services.router import pins
from pdserve.services.router.admission import Admission
from pdserve.services.router.api.parsers import ParserConfig, Parsers
from pdserve.services.router.api.responses_store import ResponseStore
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.engine_events import EngineCaches, parse_engine_events
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.gateway import Gateway
from pdserve.services.router.grpc_worker_client import GrpcWorkerClient
from pdserve.services.router.http_worker_client import DispatchingWorkerClient, HttpWorkerClient
from pdserve.services.router.kv_check import KVCheck, MasterQuarantine
from pdserve.services.router.models import Models, model_configs
from pdserve.services.router.openai_http import make_app
from pdserve.services.router.orchestrator import Orchestrator, OrchestratorConfig
from pdserve.services.router.policies import ColocatedPlacement, make_policy
from pdserve.services.router.rate_limit import RateLimits
from pdserve.services.router.request import Limits
from pdserve.services.router.servicer import RouterServicer
from pdserve.services.router.workers import DECODE, PREFILL, WorkerPool
from pdserve.tenants import Tenants
from pdserve.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    meta_pb2,
    router_pb2,
    router_pb2_grpc,
)

log = logging.getLogger(__name__)


def model_folder(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from pdserve.model.prepare import resolve_model

    return resolve_model(name_or_path)


def prefix_lookup(master: str):
    """The store master's LongestPrefix on an asyncio channel (the router only needs this
    metadata call; StoreClient.longest_prefix is the same RPC behind a thread hop)."""
    stub = kvstore_pb2_grpc.KVMasterServiceStub(grpcutil.channel(master, role="master"))

    async def lookup(keys: list[str]) -> int:
        resp = await stub.LongestPrefix(kvstore_pb2.LongestPrefixRequest(keys=keys), timeout=2.0)
        return resp.length

    return lookup


class MooncakeLookup:
    """The longest cached prefix from a Mooncake Store (``store_backend: mooncake``): a
    Mooncake client contributing no memory, its blocking calls off the event loop."""

    def __init__(self, cfg: RouterConfig) -> None:
        from pdserve.store import open_store

        self.client = open_store(cfg.store_master, backend="mooncake", **cfg.mooncake_options())

    async def __call__(self, keys: list[str]) -> int:
        return await asyncio.to_thread(self.client.longest_prefix, keys)

    def close(self) -> None:
        self.client.close()


def store_lookup(cfg: RouterConfig):
    """The prefix lookup of ``cfg.store_backend`` (None without a store)."""
    if not cfg.store_master:
        return None
    if cfg.store_backend == "mooncake":
        return MooncakeLookup(cfg)
    from pdserve.services.router.prefix_index import indexed_lookup

    return indexed_lookup(cfg.store_master, cfg.prefix_source, prefix_lookup(cfg.store_master))


@dataclass
class Shared:
    """What every model's frontend of one router shares."""

    engines: EngineCaches
    admission: Admission
    tenants: Tenants
    prefix_lookup: object
    responses: ResponseStore
    pools: list[WorkerPool]


def build(cfg: RouterConfig, tokenizer=None) -> Frontend:
    """Everything but the servers and background loops (tests drive it in-process): a
    frontend per served model (:func:`~pdserve.services.router.models.model_configs`), all
    sharing admission (the decode capacity of every model's workers), the API keys, the store
    lookup and the responses store. Returns the default model's; its ``models`` holds them
    all. ``tokenizer`` (tests) stands in for the default model's."""
    pools: list[WorkerPool] = []
    tenants = Tenants.configured(cfg.api_key, cfg.tenant_keys_file, cfg.tenant_max_inflight)
    shared = Shared(
        engines=EngineCaches(parse_engine_events(cfg.engine_kv_events)),
        admission=Admission(
            cfg.max_inflight,
            cfg.max_queue,
            slo_ttft_ms=cfg.slo_ttft_ms,
            slo_tpot_ms=cfg.slo_tpot_ms,
            capacity=lambda: sum(p.decode_capacity() for p in pools),
            tenants=tenants,  # shares (fair queueing) and per-tenant metrics
            rates=RateLimits(tenants) if tenants.limits else None,
            fair_headroom=cfg.fair_headroom,
        ),
        tenants=tenants,
        prefix_lookup=store_lookup(cfg),
        responses=ResponseStore(cfg.responses_max_stored, cfg.responses_ttl_s),
        pools=pools,
    )
    frontends = [
        build_model(mc, shared, tokenizer if i == 0 else None)
        for i, mc in enumerate(model_configs(cfg))
    ]
    models = Models(frontends)
    for fe in frontends:
        fe.models = models
    return models.default


def build_model(cfg: RouterConfig, shared: Shared, tokenizer=None) -> Frontend:
    """The frontend of the one model ``cfg`` serves: its tokenizer, limits, worker pool (the
    workers registered with its served name), KV fingerprint and orchestrator."""
    folder = model_folder(cfg.model)
    if tokenizer is None:
        from pdserve.services.router.tokenizer import Tokenizer

        tokenizer = Tokenizer(folder)
    max_len = cfg.max_model_len or getattr(tokenizer, "max_model_len", 0)
    limits = Limits(
        model=cfg.name,
        vocab_size=tokenizer.vocab_size,
        max_model_len=max_len,
        max_tokens_limit=cfg.max_tokens_limit,
        default_max_tokens=cfg.default_max_tokens,
    )
    pool = WorkerPool(
        model=cfg.name,
        breaker_failures=cfg.breaker_failures,
        breaker_cooldown_s=cfg.breaker_cooldown_s,
    )
    pool.add_static(PREFILL, cfg.prefill)
    pool.add_static(DECODE, cfg.decode)
    fingerprints = FingerprintSource(
        cfg.name,
        model_revision(folder),
        kv_dtype=cfg.kv_dtype,
        chunk_size=cfg.chunk_size,
        workers=pool.registered_labels,
        kv_compression=cfg.kv_compression,
    )
    pool.refusals = fingerprints.refusals
    engines, admission = shared.engines, shared.admission
    shared.pools.append(pool)
    pool.on_change = admission.wake
    orch = Orchestrator(
        OrchestratorConfig(
            model=cfg.name,
            default_mode=cfg.mode,
            local_prefill_threshold=cfg.local_prefill_threshold,
            prefill_retries=cfg.prefill_retries,
            chunk_wait_ms=cfg.chunk_wait_ms,
            request_timeout_s=cfg.request_timeout_s,
        ),
        client=DispatchingWorkerClient(GrpcWorkerClient(), HttpWorkerClient(tokenizer)),
        tenants=shared.tenants,
        fingerprints=fingerprints,
        pool=pool,
        policy=make_policy(
            cfg.policy,
            engines,
            cache_weight=cfg.cache_weight,
            load_weight=cfg.load_weight,
            request_tokens=cfg.request_tokens,
        ),
        admission=admission,
        prefix_lookup=shared.prefix_lookup,
        placement=ColocatedPlacement(engines=engines),
        detokenize=tokenizer.decode,
    )
    if cfg.kv_check_share > 0 and cfg.store_master:
        orch.kv_check = KVCheck(
            cfg.kv_check_settings(),
            model=cfg.name,
            client=orch.client,
            pool=pool,
            set_quarantine=(
                MasterQuarantine(cfg.store_master) if cfg.store_backend == "pdserve" else None
            ),
        )
    parsers = Parsers(ParserConfig(cfg.tool_call_parser, cfg.reasoning_parser), folder)
    if cfg.tool_call_parser or cfg.reasoning_parser:
        parsers.check()  # an unknown parser name stops the start, not the first request
    return Frontend(
        tokenizer=tokenizer,
        limits=limits,
        orchestrator=orch,
        pool=pool,
        engines=engines,
        parsers=parsers,
        responses=shared.responses,
    )


def public_tls(cfg: RouterConfig) -> tuple[bytes, bytes]:
    """(certificate, key) PEM of the public API, or empty for plaintext."""
    if not cfg.public_tls_cert:
        return b"", b""
    return Path(cfg.public_tls_cert).read_bytes(), Path(cfg.public_tls_key).read_bytes()


def public_ssl(cfg: RouterConfig) -> ssl.SSLContext | None:
    """The public HTTP API's server-side TLS: clients use API keys, but with
    ``gateway_identities`` a client certificate from the gateways' CA is asked for (optional:
    one that presents none is a client like any other)."""
    if not cfg.public_tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.public_tls_cert, cfg.public_tls_key)
    ca = gateway_ca(cfg)
    if ca:
        ctx.load_verify_locations(cadata=ca.decode())
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def gateway_ca(cfg: RouterConfig) -> bytes:
    """PEM of the CA whose gateway certificates the public API asks for (b"" = none asked;
    the gRPC port then requires one of every client: :func:`pdserve.grpcutil.start_server`)."""
    if not cfg.gateway_identities:
        return b""
    return Path(cfg.gateway_ca or cfg.tls_ca).read_bytes()


def key_failures(cfg: RouterConfig) -> KeyFailures | None:
    """The wrong-API-key limiter HTTP and gRPC share (None: no key, or no limit)."""
    limits = (cfg.api_key_failures, cfg.api_key_failures_global)
    if not (cfg.api_key or cfg.tenant_keys_file) or not any(limits):
        return None
    return KeyFailures(
        cfg.api_key_failures,
        cfg.api_key_failure_window_s,
        global_limit=cfg.api_key_failures_global,
    )


def metrics_open(cfg: RouterConfig) -> bool:
    """Whether /metrics answers without an API key (when keys are configured): metrics_open,
    or an HTTP port on loopback only (the rule of the services' metrics ports:
    :func:`pdserve.telemetry.configure_metrics`)."""
    return cfg.metrics_open or is_loopback(cfg.host)


def edge_limits(cfg: RouterConfig) -> EdgeLimits:
    return EdgeLimits(
        header_timeout_s=cfg.http_header_timeout_s,
        body_timeout_s=cfg.http_body_timeout_s,
        max_per_peer=cfg.http_max_conns_per_peer,
        max_connections=cfg.http_max_connections,
    )


@dataclass
class Running:
    frontend: Frontend
    grpc_port: int
    http_port: int


async def serve(
    cfg: RouterConfig, stop: asyncio.Event, *, frontend: Frontend | None = None, started=None
) -> None:
    """Serves until ``stop`` is set, then drains. ``started(Running)`` is called once up."""
    fe = frontend or build(cfg)
    keys = fe.orchestrator.tenants  # the API keys: whose they are, and each tenant's cap
    failures = key_failures(cfg)
    gate = Gateway.configured(
        keys, cfg.gateway_tenant_header, cfg.gateway_identities, cfg.gateway_peers
    )
    server = await grpcutil.start_server(
        [
            (
                router_pb2_grpc.add_RouterServiceServicer_to_server,
                RouterServicer(fe),
                router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
            )
        ],
        f"{cfg.host}:{cfg.port}",
        interceptors=[] if keys.open else [RequireKey(keys, failures, gate)],
        public_tls=public_tls(cfg),
        public_client_ca=gateway_ca(cfg),
    )
    runner, http_port = None, 0
    if cfg.http_port >= 0:
        app = make_app(
            fe,
            keys=keys,
            metrics_open=metrics_open(cfg),
            key_failures=failures,
            gateway=gate,
        )
        pins.add_routes(app, fe, cfg.store_master if cfg.store_backend == "pdserve" else "")
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = EdgeSite(
            runner,
            cfg.host,
            cfg.http_port,
            edge_limits(cfg),
            ssl_context=public_ssl(cfg),
            access_log=None,
        )
        await site.start()
        http_port = site.port
    models = fe.every_model()
    tasks = [asyncio.ensure_future(m.pool.probe_loop(stop)) for m in models]
    if fe.engines is not None:
        fe.engines.start()
    if cfg.meta:
        tasks += [asyncio.ensure_future(m.pool.watch_meta(cfg.meta, stop)) for m in models]
    checks = [m.orchestrator.kv_check for m in models if m.orchestrator.kv_check is not None]
    tasks += [asyncio.ensure_future(check.run(stop)) for check in checks]
    if started is not None:
        started(Running(fe, server.port, http_port))
    meta_client = await register_service(
        cfg.meta,
        meta_pb2.Instance(
            instance_id=f"router-{cfg.host}-{server.port}",
            role=common_pb2.ROLE_ROUTER,
            address=advertised(cfg, server.port),
            model=cfg.name,
            labels={"http": advertised(cfg, http_port)} if http_port else {},
        ),
    )
    scheme = "https" if cfg.public_tls_cert else "http"
    lifecycle.announce_ready(
        "router", grpc=f"{cfg.host}:{server.port}", http=f"{scheme}://{cfg.host}:{http_port}"
    )
    try:
        await stop.wait()
    finally:
        await leave(meta_client)
        server.set_serving(False)
        await server.stop(5.0)
        if runner is not None:
            await runner.cleanup()
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if fe.engines is not None:
            await fe.engines.aclose()
        for m in models:
            await m.pool.close()
            if isinstance(m.orchestrator.client, DispatchingWorkerClient):
                await m.orchestrator.client.http.close()  # its session to stock vLLM engines
        close = getattr(fe.orchestrator.prefix_lookup, "close", None)
        if close is not None:
            close()
        for check in checks:
            if isinstance(check.set_quarantine, MasterQuarantine):
                check.set_quarantine.close()
