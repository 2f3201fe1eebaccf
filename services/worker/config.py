"""The worker service's configuration: the engine fields plus what every worker needs (both
roles take it: ``PrefillConfig`` and ``DecodeConfig`` add nothing but their docs)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ConfigError, help_field
from pdserve.engines.config import EngineConfig
from pdserve.identity import SecurityConfig
from pdserve.telemetry import MetricsConfig


@dataclass
class WorkerConfig(SecurityConfig, MetricsConfig, EngineConfig):
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

    def default_max_tokens(self, max_model_len: int, prompt_len: int) -> int:
        """``max_tokens`` of a request that leaves it 0: as many as the limit and the context
        allow (at least 1; a prompt that fills the context is then refused by the engine)."""
        return max(
            1, min(self.resolved_max_tokens_limit(max_model_len), max_model_len - prompt_len)
        )
