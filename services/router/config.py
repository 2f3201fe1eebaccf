"""Configuration of the router (section ``router``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.auth import load_key
from pdserve.config import ConfigError, help_field
from pdserve.enums import DISAGG_MODE
from pdserve.hashing import KV_COMPRESSIONS
from pdserve.identity import SecurityConfig
from pdserve.services.router import gateway
from pdserve.services.router.engine_events import parse_engine_events
from pdserve.services.router.kv_check import KVCheckSettings
from pdserve.services.router.models import check_models
from pdserve.store import StoreBackendConfig
from pdserve.tenants import Tenants

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass
class RouterConfig(SecurityConfig, StoreBackendConfig):
    host: str = help_field("127.0.0.1", "interface the gRPC and HTTP servers bind")
    port: int = help_field(50050, "gRPC port of RouterService (0 = a free port)")
    http_port: int = help_field(
        8000, "OpenAI-compatible HTTP port, also serving /health and /metrics (0 = free, -1 = off)"
    )
    meta: str = help_field("", "meta service address host:port for worker discovery")
    store_master: str = help_field(
        "", "KV store master host:port, asked for the longest cached prefix ('' = never cached)"
    )
    prefix_source: str = help_field(
        "auto",
        "where the longest cached prefix comes from: events (an index the master's KV events "
        "keep, the master asked only while it is out of sync), master (a LongestPrefix call "
        "per request), auto (events when the master offers them)",
    )
    model: str = help_field(
        "tiny", "model folder, or a name that pdserve.model.prepare.resolve_model knows"
    )
    served_name: str = help_field("", "model name in requests and on workers ('' = --model)")
    models: list[str] = help_field(
        [],
        "several models behind this router, SERVED=MODEL or MODEL each (served name in requests "
        "and on the workers, model folder or name), comma-separated; the first is the default "
        "(requests without a model) and replaces model/served_name ([] = model alone). Each "
        "model has its own workers, fingerprint and tokenizer (services/router/models.py)",
        metavar="SERVED=MODEL,...",
    )
    model_settings: dict = help_field(
        {},
        "per served name of models, its own values of the router fields that belong to a model "
        "(max_model_len, max_tokens_limit, default_max_tokens, kv_dtype, chunk_size, "
        "kv_compression, tool_call_parser, reasoning_parser, and static prefill/decode "
        'workers): YAML, or JSON in a flag: {"b": {"max_model_len": 2048}}',
        metavar="JSON",
    )
    kv_dtype: str = help_field(
        "auto",
        "KV dtype of the workers, part of the chunk keys (auto = what the workers registered)",
    )
    chunk_size: int = help_field(
        0, "tokens per KV chunk, part of the chunk keys (0 = what the workers registered)"
    )
    kv_compression: str = help_field(
        "auto",
        "KV chunk encoding of the workers (none, bf16, fp8), part of the chunk keys (auto = "
        "what the workers registered; none when none did)",
    )
    max_model_len: int = help_field(
        0,
        "prompt + output limit in tokens (0 = the model's); never above the smallest limit the "
        "workers registered, so a prompt no worker can take is refused here, not deep inside",
    )
    max_tokens_limit: int = help_field(4096, "largest max_tokens a request may ask for")
    default_max_tokens: int = help_field(256, "max_tokens when a request leaves it unset")
    policy: str = help_field("cache_aware", f"prefill routing policy: {', '.join(POLICIES)}")
    mode: str = help_field("read", f"default orchestration mode: {', '.join(DISAGG_MODE.choices)}")
    local_prefill_threshold: int = help_field(
        32, "uncached prompt tokens below which the decode worker prefills locally (0 = never)"
    )
    cache_weight: float = help_field(
        1.0, "cache-aware policy: cost weight of each uncached prompt token"
    )
    load_weight: float = help_field(
        1.0, "cache-aware policy: cost weight of each token of queued prefill work"
    )
    request_tokens: int = help_field(
        256, "tokens of prefill work assumed per request a worker reports as queued/running"
    )
    max_inflight: int = help_field(
        0,
        "requests orchestrated at once; more wait in the queue, out of the workers' sight "
        "(0 = the decode workers' max_num_seqs summed, 64 until one registers it)",
    )
    max_queue: int = help_field(256, "requests one tenant may have waiting; beyond that 429")
    fair_headroom: int = help_field(
        4,
        "in-flight slots beyond max_inflight for tenants below their fair share of it (by "
        "their recent average), so they are admitted at once, not after another tenant's "
        "requests end (0 = none)",
    )
    slo_ttft_ms: float = help_field(0.0, "reject requests predicted to miss this TTFT (0 = off)")
    slo_tpot_ms: float = help_field(
        0.0, "reject requests while time per output token exceeds this (0 = off)"
    )
    prefill_retries: int = help_field(1, "retries of a failed prefill on another worker")
    breaker_failures: int = help_field(3, "consecutive failures that take a worker out")
    breaker_cooldown_s: float = help_field(5.0, "seconds before a broken worker is probed")
    chunk_wait_ms: int = help_field(30000, "write mode: how long decode waits for each chunk")
    request_timeout_s: float = help_field(600.0, "deadline of a request without its own (s)")
    prefill: list[str] = help_field(
        [],
        "static prefill worker addresses (instead of meta): host:port of a pdserve worker, or "
        "http://host:port of a stock 'vllm serve' with pdserve's connector as kv_producer or "
        "kv_both (docs/vllm-connector.md)",
    )
    decode: list[str] = help_field(
        [],
        "static decode worker addresses (instead of meta): host:port, or http://host:port of a "
        "stock 'vllm serve' with pdserve's connector as kv_consumer or kv_both",
    )
    engine_kv_events: list[str] = help_field(
        [],
        "URL=ENDPOINT[+REPLAY], comma-separated, one per engine: the KV event publisher of the "
        "stock engine at URL (a --prefill or --decode http:// address) as its vllm serve "
        '--kv-events-config binds it: \'{"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
        "-> http://HOST:8000=tcp://HOST:5557+tcp://HOST:5558. Placement then knows which engine "
        "holds a prompt's prefix in its own cache (services/router/engine_events.py)",
    )
    api_key: str = help_field(
        "",
        "key every client must present: HTTP 'Authorization: Bearer KEY', gRPC metadata "
        "'authorization: Bearer KEY' ('' = open; /health and gRPC health stay open). Prefer "
        "PDSERVE_ROUTER_API_KEY or api_key_file to a flag, which other users can see in ps",
    )
    api_key_file: str = help_field("", "file whose first line is the API key")
    tenant_keys_file: str = help_field(
        "",
        "file of tenants, one 'NAME KEY [share=N] [rps=N] [tps=N]' a line (keys of 16+ "
        "characters): each key is a tenant with its own cache namespace, cached_tokens, "
        "requests to abort and in-flight cap, its share of a saturated router's admissions and "
        "its rate limits in requests and prompt tokens per second (pdserve/tenants.py); "
        "api_key, if also given, is the tenant 'default'",
    )
    tenant_max_inflight: int = help_field(
        0, "requests one tenant may have in flight; past it 429 / RESOURCE_EXHAUSTED (0 = no cap)"
    )
    metrics_open: bool = help_field(
        False,
        "serve /metrics on the HTTP port without a key although API keys are configured (on "
        "a loopback host it is open anyway); else Prometheus sends one: authorization: "
        "{credentials_file: FILE}",
    )
    api_key_failures: int = help_field(
        10,
        "times one client address may present the same wrong API key within "
        "api_key_failure_window_s; past that it is answered HTTP 429 with Retry-After (gRPC "
        "RESOURCE_EXHAUSTED) until the window ends. A right key is always served (0 = no limit)",
        metavar="N",
    )
    api_key_failures_global: int = help_field(
        100,
        "wrong API keys all client addresses together may present within "
        "api_key_failure_window_s; past that each wrong key is answered 429 until the window "
        "ends. A right key is always served (0 = no limit)",
        metavar="N",
    )
    api_key_failure_window_s: float = help_field(
        60.0, "seconds from a first wrong API key over which api_key_failures(_global) count"
    )
    http_header_timeout_s: float = help_field(
        10.0,
        "seconds an HTTP connection has, from opening or from its previous response, to send "
        "a complete request head (request line and headers); then it is closed. So also the "
        "longest a kept-alive connection stays idle",
    )
    http_body_timeout_s: float = help_field(
        30.0, "seconds an HTTP request body may take to arrive once its head has; then closed"
    )
    http_max_conns_per_peer: int = help_field(
        128,
        "open HTTP connections one client address may hold; a further one is answered 429 and "
        "closed at once, unread (0 = no cap; a gateway, NAT or load generator is one address)",
        metavar="N",
    )
    http_max_connections: int = help_field(
        4096,
        "open HTTP connections from all client addresses together; a further one is answered "
        "503 and closed at once, unread (0 = no cap; never above a quarter of the process's "
        "file-descriptor limit)",
        metavar="N",
    )
    public_tls_cert: str = help_field(
        "",
        "certificate (PEM) for TLS on the public gRPC and HTTP API; optional, as a gateway "
        "usually terminates TLS (tls_* is the router's identity toward the other services)",
    )
    public_tls_key: str = help_field("", "private key (PEM) of public_tls_cert")
    gateway_tenant_header: str = help_field(
        "x-pdserve-tenant",
        "header in which a trusted gateway names the caller's tenant (docs/gateway.md); from "
        "anyone else it is refused (403 / PERMISSION_DENIED)",
    )
    gateway_identities: list[str] = help_field(
        [],
        "names (CN) of the gateway certificates (OU gateway, `pdserve certs gateway:NAME`) "
        "trusted to set gateway_tenant_header, over mutual TLS on the public API (needs "
        "public_tls_cert and gateway_ca or tls_ca; the gRPC port then requires a certificate "
        "from that CA of every client, HTTP asks for one)",
    )
    gateway_peers: list[str] = help_field(
        [],
        "addresses or CIDRs of the gateways trusted to set gateway_tenant_header (connections "
        "from them, e.g. 10.0.0.7 or 10.0.0.0/24)",
    )
    gateway_ca: str = help_field(
        "", "CA (PEM) that signs the gateways' client certificates ('' = tls_ca)"
    )
    kv_check_share: float = help_field(
        0.01,
        "share of requests served from the store (prompt KV loaded) that a worker recomputes "
        "cold, off the client's path, to compare its tokens (docs/router.md, KV check; 0 = off)",
    )
    kv_check_tokens: int = help_field(4, "greedy tokens each KV check run generates")
    kv_check_tolerance: float = help_field(
        0.5,
        "logit gap (nats) above which a token flip between the stored and the cold run is a "
        "divergence; at or below it, a near tie",
    )
    kv_check_window: int = help_field(20, "KV checks per fingerprint the divergence rate covers")
    kv_check_min: int = help_field(3, "KV checks a fingerprint needs before it can be quarantined")
    kv_check_max_divergence: float = help_field(
        0.05,
        "divergence rate over the window above which the fingerprint is quarantined: the "
        "master answers its chunks as not found until an operator clears it",
    )
    kv_check_queue: int = help_field(
        16, "sampled KV checks waiting at most; more are dropped (counted)"
    )
    tool_call_parser: str = help_field(
        "",
        "vLLM tool call parser for tool_choice auto (vLLM's --tool-call-parser, e.g. hermes; "
        "'' = auto refused, required and named still work)",
    )
    reasoning_parser: str = help_field(
        "", "vLLM reasoning parser (vLLM's --reasoning-parser, e.g. qwen3; '' = none)"
    )
    responses_max_stored: int = help_field(
        1000, "/v1/responses kept for previous_response_id at most (oldest dropped first)"
    )
    responses_ttl_s: float = help_field(
        3600.0, "how long a stored /v1/responses answer stays usable as previous_response_id (s)"
    )
    log_level: str = help_field("info", "log level")

    @property
    def name(self) -> str:
        return self.served_name or self.model

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.mode not in DISAGG_MODE.choices:
            raise ConfigError(f"mode must be one of {DISAGG_MODE.choices}, got {self.mode!r}")
        if self.chunk_size < 0:
            raise ConfigError("chunk_size must be positive (or 0 = from the workers)")
        if self.kv_compression not in ("auto", *KV_COMPRESSIONS):
            raise ConfigError(
                f"kv_compression must be auto or one of {KV_COMPRESSIONS}, "
                f"got {self.kv_compression!r}"
            )
        self.check_store_backend()
        if self.prefix_source not in ("auto", "events", "master"):
            raise ConfigError(
                f"prefix_source must be auto, events or master, got {self.prefix_source!r}"
            )
        if self.max_inflight < 0 or self.max_queue < 0:
            raise ConfigError(
                f"max_inflight ({self.max_inflight}) and max_queue ({self.max_queue}) must be "
                ">= 0 (max_inflight 0 = the workers' capacity)"
            )
        if self.fair_headroom < 0:
            raise ConfigError(f"fair_headroom must be >= 0 (0 = none), got {self.fair_headroom}")
        check_models(self)
        if not self.meta and not self.decode and not self.models:
            raise ConfigError("give --meta or at least one --decode worker address")
        if not self.meta and self.store_master and (self.kv_dtype == "auto" or not self.chunk_size):
            raise ConfigError(
                "with static worker addresses (no --meta) the router cannot learn the workers' "
                "KV settings: give --kv-dtype and --chunk-size as the workers have them"
            )
        try:
            engines = parse_engine_events(self.engine_kv_events)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        static = {*self.prefill, *self.decode}
        for settings in self.model_settings.values():
            static |= {*settings.get("prefill", ()), *settings.get("decode", ())}
        for url in engines:
            if url not in static:
                raise ConfigError(
                    f"engine_kv_events names {url}, which is no --prefill or --decode address "
                    f"(those are {sorted(a for a in static if a.startswith('http'))})"
                )
        if self.prefill_retries < 0 or self.breaker_failures <= 0:
            raise ConfigError("prefill_retries must be >= 0 and breaker_failures positive")
        if self.default_max_tokens <= 0 or self.max_tokens_limit <= 0:
            raise ConfigError("default_max_tokens and max_tokens_limit must be positive")
        if self.http_header_timeout_s <= 0 or self.http_body_timeout_s <= 0:
            raise ConfigError("http_header_timeout_s and http_body_timeout_s must be positive")
        if self.api_key_failure_window_s <= 0:
            raise ConfigError("api_key_failure_window_s must be positive")
        if min(self.http_max_conns_per_peer, self.http_max_connections, self.api_key_failures) < 0:
            raise ConfigError(
                "http_max_conns_per_peer, http_max_connections and api_key_failures must be >= 0 "
                "(0 = off)"
            )
        if self.api_key_failures_global < 0:
            raise ConfigError("api_key_failures_global must be >= 0 (0 = off)")
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ConfigError("public TLS needs both public_tls_cert and public_tls_key")
        self.api_key = load_key(self.api_key, self.api_key_file)
        self.api_key_file = ""
        if self.tenant_max_inflight < 0:
            raise ConfigError("tenant_max_inflight must be >= 0 (0 = no cap)")
        if self.tenant_max_inflight and not self.tenant_keys_file:
            raise ConfigError("tenant_max_inflight needs tenant_keys_file (tenants to cap)")
        if self.tenant_keys_file:
            Tenants.load(self.tenant_keys_file, self.api_key)  # a bad file fails at start
        gateway.check_config(
            self.gateway_tenant_header,
            self.gateway_identities,
            self.gateway_peers,
            tenants_file=self.tenant_keys_file,
            public_tls=bool(self.public_tls_cert),
            ca=self.gateway_ca or self.tls_ca,
        )
        self.check_kv_check()

    def check_kv_check(self) -> None:
        if not 0.0 <= self.kv_check_share <= 1.0:
            raise ConfigError(f"kv_check_share must be in [0, 1], got {self.kv_check_share}")
        if not 1 <= self.kv_check_tokens <= 64:
            raise ConfigError(f"kv_check_tokens must be in [1, 64], got {self.kv_check_tokens}")
        if self.kv_check_tolerance < 0:
            raise ConfigError(f"kv_check_tolerance must be >= 0, got {self.kv_check_tolerance}")
        if not 1 <= self.kv_check_min <= self.kv_check_window:
            raise ConfigError(
                f"kv_check_min ({self.kv_check_min}) must be in [1, kv_check_window "
                f"({self.kv_check_window})]"
            )
        if not 0.0 <= self.kv_check_max_divergence < 1.0:
            raise ConfigError(
                f"kv_check_max_divergence must be in [0, 1), got {self.kv_check_max_divergence}"
            )
        if self.kv_check_queue < 1:
            raise ConfigError(f"kv_check_queue must be >= 1, got {self.kv_check_queue}")

    def kv_check_settings(self) -> KVCheckSettings:
        return KVCheckSettings(
            share=self.kv_check_share,
            tokens=self.kv_check_tokens,
            tolerance=self.kv_check_tolerance,
            window=self.kv_check_window,
            min_checks=self.kv_check_min,
            max_divergence=self.kv_check_max_divergence,
            queue=self.kv_check_queue,
        )
