"""Configuration of the KV store master (section ``kvstore_master``). Import-light: the CLI
builds its flags from this dataclass without loading gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import ConfigError, help_field
from pdserve.etcdaccess import EtcdAccess
from pdserve.identity import SecurityConfig
from pdserve.telemetry import MetricsConfig


@dataclass
class MasterConfig(SecurityConfig, MetricsConfig):
    host: str = help_field("127.0.0.1", "address to bind the gRPC server to")
    port: int = help_field(50051, "gRPC port (0 = any free port)")
    metrics_port: int = help_field(0, "Prometheus /metrics port (0 = any free port, -1 = off)")
    wire_port: int = help_field(
        0,
        "control wire port: the store clients' hot calls without HTTP/2, found through "
        "GetControlWire (0 = any free port, -1 = off: clients use gRPC)",
    )
    state_dir: str = help_field(
        "~/.local/state/pdserve/kvstore-master",
        "directory for the committed-object metadata (SQLite), so a restarted master finds "
        "every object again when the nodes remount; one master per directory (locked). "
        "Empty = in memory only: a restart then forgets every object",
    )
    ha_etcd: list[str] = field(
        default_factory=list,
        metadata={
            "help": "etcd host:port list: run as one of several masters, one leader elected "
            "through etcd, the objects kept in etcd instead of state_dir (empty = a single "
            "master). Standbys bind nothing until they lead; clients list every master "
            "(HOST:PORT,HOST:PORT). Needs a fixed --port (services/kvstore/master/ha.py)",
            "metavar": "HOST:PORT,...",
        },
    )
    ha_etcd_ca: str = help_field(
        "", "CA certificate (PEM) of etcd's server certificate: reach ha_etcd over TLS"
    )
    ha_etcd_cert: str = help_field(
        "", "client certificate (PEM) for an etcd that requires one (--client-cert-auth)"
    )
    ha_etcd_key: str = help_field("", "private key (PEM) of ha_etcd_cert")
    ha_etcd_server_name: str = help_field(
        "", "host name checked in etcd's server certificates (needed with several endpoints)"
    )
    ha_etcd_user: str = help_field("", "etcd user to authenticate as (etcd auth enabled)")
    ha_etcd_password_file: str = help_field("", "file whose first line is ha_etcd_user's password")
    ha_prefix: str = help_field("/pdserve/kvstore/", "etcd key prefix of the masters' state")
    ha_lease_s: int = help_field(
        2,
        "seconds the leader's etcd lease lasts without renewal: how long a dead or paused "
        "leader holds on before a standby takes over (it renews every third of it)",
    )
    log_level: str = help_field("info", "log level")
    meta: str = help_field("", "meta service address host:port to register with (empty = none)")
    data_tokens: bool = help_field(
        True,
        "hand out a short-lived grant with every replica (read: until the lease ends; write: "
        "until the put times out) and give nodes the keys to check them, so a node's tcp "
        "data port serves only ranges the master granted. Off: nodes accept any range; for "
        "benchmarks and trusted single-host setups",
    )
    # Liveness
    heartbeat_interval_ms: int = help_field(500, "heartbeat period told to nodes (ms)")
    heartbeat_miss_limit: int = help_field(
        3, "a node is dead after this many missed heartbeat periods (total must be < 3 s)"
    )
    tick_interval_ms: int = help_field(
        100, "period of the housekeeping pass: dead nodes, TTLs, put timeouts, watermarks (ms)"
    )
    dormant_grace_s: float = help_field(
        120.0,
        "after a restart, persisted replicas whose segment does not remount within this "
        "time are dropped (s)",
    )
    max_repairs_per_tick: int = help_field(
        16,
        "objects that lost a replica (a dead node) get a new copy on another node in the "
        "background: copies started per housekeeping pass (0 = no re-replication)",
    )
    max_tier_moves_per_tick: int = help_field(
        16,
        "copies between a node's memory and its disk tier started per housekeeping pass: "
        "down before memory evicts, up after a read of a disk-only object (0 = no moves: "
        "disk tiers stay empty)",
    )
    demote_watermark: float = help_field(
        0.75,
        "a node's least recently used objects get a disk copy once its memory passes this used "
        "fraction (below low_watermark, so what memory evicts is on disk already)",
    )
    # Objects and puts
    default_replicas: int = help_field(1, "replicas per put when the request says 0")
    max_replicas: int = help_field(8, "most replicas one put may ask for")
    put_timeout_s: float = help_field(
        30.0, "an unfinished put's reserved space is reclaimed after this long (s)"
    )
    default_lease_ms: int = help_field(5000, "read lease granted by a get when the request says 0")
    inline_max_bytes: int = help_field(
        16384,
        "objects up to this size may be sent inline with their put and are then also kept in "
        "the master's memory, so a get of them needs no data-plane read (0 = off)",
    )
    inline_capacity_bytes: int = help_field(
        64 << 20, "bytes of inline objects the master keeps at most; later ones are not inlined"
    )
    max_lease_ms: int = help_field(60000, "longest read lease a get may ask for (ms)")
    max_ttl_ms: int = help_field(86_400_000, "longest TTL a put may ask for (ms)")
    # Eviction
    high_watermark: float = help_field(
        0.95, "evict when a segment's or the pool's used fraction passes this"
    )
    low_watermark: float = help_field(0.85, "evict down to this used fraction")
    idle_fingerprint_s: float = help_field(
        600.0,
        "a model fingerprint with no put and no hit for this long is idle (no live worker "
        "serves it): eviction takes its chunks before the least recently used of the others (s)",
    )
    max_evictions_per_alloc: int = help_field(
        4096, "most objects evicted to make room for one allocation"
    )
    tenant_shares: dict[str, object] = help_field(
        {},
        "tenant -> its share of the pool (KVNamespace.tenant; docs/architecture.md, 'Tenant "
        "shares and pins'): a fraction in (0, 1] of each tier's capacity, a size (bytes, "
        "512MiB), or {memory: ..., disk: ...}; eviction takes over-share tenants' objects "
        "first, and a tenant's pinned bytes stay within its memory share (JSON on a flag)",
        metavar="JSON",
    )
    tenant_shares_file: str = help_field(
        "", "YAML or JSON file of tenant -> share, as tenant_shares (whose entries win)"
    )
    default_tenant_share: str = help_field(
        "1", "share of tenants not listed, and of objects of no tenant (1 = the whole pool)"
    )
    # Input limits
    max_key_bytes: int = help_field(256, "longest key (UTF-8 bytes)")
    max_object_bytes: int = help_field(1 << 30, "largest object (bytes)")
    max_batch_keys: int = help_field(4096, "most keys in one batched call")
    max_segment_bytes: int = help_field(1 << 40, "largest segment a node may mount (bytes)")
    max_id_bytes: int = help_field(128, "longest segment / node / client id (UTF-8 bytes)")
    max_held_objects: int = help_field(
        100_000,
        "most held objects re-reported in one mount (restored in linear time, about 1 s per "
        "100,000 on a small machine, during which the master answers nothing else)",
    )
    event_queue_size: int = help_field(
        10000, "events buffered per WatchEvents subscriber; the oldest are dropped beyond it"
    )
    kv_events_endpoint: str = help_field(
        "",
        "ZMQ PUB endpoint of the KV events in vLLM's KVEventBatch wire format, e.g. "
        "tcp://127.0.0.1:5557 ('' = off). ZMQ has no authentication: a non-loopback address "
        "needs --insecure. Needs pyzmq and msgspec (installed with vLLM)",
    )
    kv_events_replay_endpoint: str = help_field(
        "", "ZMQ ROUTER endpoint answering replay requests from a sequence number ('' = off)"
    )
    kv_events_topic: str = help_field("", "topic frame of every ZMQ KV event message")
    kv_events_buffer: int = help_field(
        1000,
        "KV event batches kept for replay (SubscribeKVEvents from_seq, ZMQ replay); a batch "
        "of 16 chunks of 256 tokens holds about 25 KB of token ids",
    )
    kv_events_queue: int = help_field(
        10000,
        "KV event batches queued per SubscribeKVEvents subscriber; one further behind is cut "
        "off (its stream ends and it resubscribes)",
    )
    kv_events_medium: str = help_field(
        "CPU", "medium of the KV events for blocks whose writer named none (vLLM's CPU, GPU...)"
    )
    kv_events_hashes: str = help_field(
        "chunk",
        "block hashes of the ZMQ KV events: 'chunk' (pdserve's chunk keys, block size = chunk "
        "size) or 'engine' (vLLM's own block hashes and block size where the writer gave "
        "them, as an indexer that hashes prompts like vLLM expects; a chunk without them "
        "keeps its key). SubscribeKVEvents carries both",
    )

    def validate(self) -> None:
        dead_after = self.heartbeat_interval_ms * self.heartbeat_miss_limit
        if self.heartbeat_interval_ms <= 0 or self.heartbeat_miss_limit <= 0:
            raise ConfigError("heartbeat_interval_ms and heartbeat_miss_limit must be > 0")
        if dead_after + self.tick_interval_ms >= 3000:
            raise ConfigError(
                f"heartbeat_interval_ms * heartbeat_miss_limit + tick_interval_ms = "
                f"{dead_after + self.tick_interval_ms} ms; a dead node must be detected "
                "within 3000 ms"
            )
        if self.ha_etcd and self.port <= 0:
            raise ConfigError("ha_etcd needs a fixed --port: clients list every master's address")
        self.etcd_access().check()
        if not 1 <= self.ha_lease_s <= 60:
            raise ConfigError(f"ha_lease_s must be 1 to 60, got {self.ha_lease_s}")
        if self.idle_fingerprint_s <= 0:
            raise ConfigError(f"idle_fingerprint_s must be > 0, got {self.idle_fingerprint_s}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("need 0 < low_watermark <= high_watermark <= 1")
        if not 0.0 <= self.demote_watermark <= 1.0:
            raise ConfigError(f"demote_watermark must be in [0, 1], got {self.demote_watermark}")
        if self.max_tier_moves_per_tick < 0:
            raise ConfigError(
                f"max_tier_moves_per_tick must be >= 0, got {self.max_tier_moves_per_tick}"
            )
        if not 1 <= self.default_replicas <= self.max_replicas:
            raise ConfigError("need 1 <= default_replicas <= max_replicas")
        for name in (
            "max_key_bytes",
            "max_object_bytes",
            "max_batch_keys",
            "max_lease_ms",
            "default_lease_ms",
            "event_queue_size",
            "kv_events_buffer",
            "kv_events_queue",
            "tick_interval_ms",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.inline_max_bytes < 0 or self.inline_capacity_bytes < 0:
            raise ConfigError("inline_max_bytes and inline_capacity_bytes must be >= 0")
        self._check_kv_events()
        from pdserve.services.kvstore.master.shares import Shares

        Shares.configured(self.tenant_shares, self.tenant_shares_file, self.default_tenant_share)
        if self.default_lease_ms > self.max_lease_ms:
            raise ConfigError("default_lease_ms must be <= max_lease_ms")

    def etcd_access(self) -> EtcdAccess:
        """How this master reaches ``ha_etcd`` (reads the password file)."""
        from pdserve.auth import load_key

        password = load_key("", self.ha_etcd_password_file, name="ha_etcd_password_file")
        return EtcdAccess(
            tuple(self.ha_etcd),
            ca=self.ha_etcd_ca,
            cert=self.ha_etcd_cert,
            key=self.ha_etcd_key,
            server_name=self.ha_etcd_server_name,
            user=self.ha_etcd_user,
            password=password,
            fields="ha_etcd_",
        )

    def _check_kv_events(self) -> None:
        from pdserve.identity import is_loopback

        if self.kv_events_hashes not in ("chunk", "engine"):
            raise ConfigError(
                f"kv_events_hashes must be 'chunk' or 'engine', got {self.kv_events_hashes!r}"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_endpoint:
            import importlib.util

            missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(
                    f"kv_events_endpoint needs pyzmq and msgspec ({', '.join(missing)} missing: "
                    "pip install pyzmq msgspec; vLLM installs both)"
                )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            ep = getattr(self, name)
            if not ep:
                continue
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name} must be a tcp://, ipc:// or inproc:// endpoint")
            host = ep[len("tcp://") :].rsplit(":", 1)[0] if ep.startswith("tcp://") else ""
            if host and not self.insecure and not is_loopback(host):
                raise ConfigError(
                    f"{name}={ep!r} would publish KV events to other hosts, and ZMQ has no "
                    "authentication: bind 127.0.0.1 or pass --insecure to accept the risk"
                )
