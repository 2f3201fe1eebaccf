"""Configuration of a KV store storage node (section ``kvstore_node``). Import-light: the CLI
builds its flags from this dataclass without loading gRPC."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from pdserve.config import ConfigError, help_field
from pdserve.enums import TRANSPORT
from pdserve.identity import SecurityConfig
from pdserve.sizes import parse_size
from pdserve.store.netio import HANDSHAKE_TIMEOUT_S, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER
from pdserve.store.segment import fs_type, memory_backed
from pdserve.telemetry import MetricsConfig

#: The transports a node may serve: every value of the proto enum (shm, tcp, mooncake).
TRANSPORTS = TRANSPORT.choices


@dataclass
class NodeConfig(SecurityConfig, MetricsConfig):
    master_address: str = help_field("127.0.0.1:50051", "KV store master gRPC address (host:port)")
    node_id: str = help_field(
        "", "stable id of this node; segments are named <node id>-seg<i> (empty = hostname-pid)"
    )
    segment_sizes: list[str] = help_field(
        ["256MiB"],
        "memory segments to contribute, comma-separated sizes (e.g. 1GiB,1GiB)",
        metavar="SIZES",
    )
    transports: list[str] = help_field(
        ["shm", "tcp"],
        "data-plane transports to serve, comma-separated: shm, tcp, mooncake",
        metavar="LIST",
    )
    disk_path: str = help_field(
        "",
        "directory of this node's disk tier, on a local disk (not tmpfs): chunks memory is "
        "about to evict are copied here and read back from here; the file survives a restart "
        "(empty = no disk tier)",
        metavar="DIR",
    )
    disk_size: str = help_field(
        "0",
        "size limit of the disk tier (e.g. 20GiB; a sparse file: space is taken as chunks "
        "arrive; 0 = no disk tier)",
        metavar="SIZE",
    )
    prefault: bool = help_field(
        True,
        "allocate and map every segment page at start: fails fast when /dev/shm is too small "
        "and keeps page faults out of the data path",
    )
    host: str = help_field("127.0.0.1", "address the data servers and the gRPC server bind to")
    tcp_port: int = help_field(0, "port of the tcp data server (0 = any free port)")
    idle_timeout_s: float = help_field(
        120.0,
        "the tcp data server closes a connection whose receive or send waits this long (s): "
        "idle pooled connections and peers stalled mid-request; clients reconnect",
    )
    handshake_timeout_s: float = help_field(
        HANDSHAKE_TIMEOUT_S,
        "the tcp data server closes a new connection whose first request header has not "
        "arrived this long after it connected (s), however slowly its bytes come",
    )
    max_connections_per_peer: int = help_field(
        MAX_CONNECTIONS_PER_PEER,
        f"connections one peer address may hold open on the tcp data server; more from it are "
        f"closed at once while other peers still connect (beneath the server's cap of "
        f"{MAX_CONNECTIONS} in all)",
        metavar="N",
    )
    tcp_follow_cpu: bool = help_field(
        True,
        "serve each parallel stream of a transfer from a client on this host on the CPU its "
        "request came from (both ends of a loopback stream on one core: steadier and faster "
        "batch reads); off leaves the serving threads to the scheduler",
    )
    grant_clock_skew_ms: int = help_field(
        2000,
        "the tcp data server accepts a grant this long past its expiry (ms): expiries are the "
        "master's clock, and an NTP-synced host is well within 2 s of it; small next to the "
        "read lease (5 s by default) and the put timeout (30 s) the grants last",
    )
    port: int = help_field(0, "gRPC port of the node's Stats service (0 = any free port)")
    host_id: str = help_field(
        "", "id of this host for the shm transport (empty = PDSERVE_HOST_ID or machine/boot id)"
    )
    metrics_port: int = help_field(-1, "Prometheus /metrics port (0 = any free port, -1 = off)")
    log_level: str = help_field("info", "log level")
    meta: str = help_field("", "meta service address host:port to register with (empty = none)")

    def validate(self) -> None:
        if not self.master_address or ":" not in self.master_address:
            raise ConfigError(f"master_address must be host:port, got {self.master_address!r}")
        if not self.node_id:
            self.node_id = f"{socket.gethostname()}-{os.getpid()}"
        if self.idle_timeout_s <= 0:
            raise ConfigError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if self.handshake_timeout_s <= 0:
            raise ConfigError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if not 1 <= self.max_connections_per_peer <= MAX_CONNECTIONS:
            raise ConfigError(
                f"max_connections_per_peer must be in [1, {MAX_CONNECTIONS}], got "
                f"{self.max_connections_per_peer}"
            )
        if self.grant_clock_skew_ms < 0:
            raise ConfigError(f"grant_clock_skew_ms must be >= 0, got {self.grant_clock_skew_ms}")
        if not self.segment_sizes:
            raise ConfigError("segment_sizes must name at least one segment")
        try:
            self.segment_bytes()
        except ValueError as exc:
            raise ConfigError(f"segment_sizes: {exc}") from exc
        try:
            disk = parse_size(self.disk_size, what="disk_size", minimum=0)
        except ValueError as exc:
            raise ConfigError(f"disk_size: {exc}") from exc
        if disk and not self.disk_path:
            raise ConfigError("disk_size is set but disk_path is empty: name the tier's directory")
        if disk and "tcp" not in self.transports:
            raise ConfigError("a disk tier is served over tcp: add tcp to transports")
        if disk and memory_backed(self.disk_path):
            raise ConfigError(
                f"disk_path {self.disk_path!r} is on {fs_type(self.disk_path)} (memory), not a "
                "disk: a disk tier there only takes memory from the segments"
            )
        unknown = sorted(set(self.transports) - set(TRANSPORTS))
        if unknown or not self.transports:
            raise ConfigError(
                f"transports: unknown {unknown or 'empty list'}; choose from {', '.join(TRANSPORTS)}"
            )

    def segment_bytes(self) -> list[int]:
        return [parse_size(s, what="segment_sizes") for s in self.segment_sizes]

    def disk_bytes(self) -> int:
        """Size of the disk tier (0 = none)."""
        return parse_size(self.disk_size, what="disk_size", minimum=0) if self.disk_path else 0
