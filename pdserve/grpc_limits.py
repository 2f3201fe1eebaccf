"""What the connections of one gRPC server may take, set once per process at service start
(:func:`configure`) and applied by :func:`pdserve.grpcutil.start_server` to every server.

- A first-frame deadline (``grpc_handshake_timeout_s``, gRPC core's
  ``grpc.server_handshake_timeout_ms``, default 120 s there): a connection must finish its TLS
  handshake and send HTTP/2's preface and SETTINGS within it, else the server closes it. An idle
  TCP connection thus holds a file descriptor for seconds, not minutes. A connection that has
  sent its SETTINGS is an HTTP/2 connection and stays (keepalive pings keep pdserve's channels).
- A cap on open connections (``grpc_max_connections``, gRPC core's
  ``grpc.max_allowed_incoming_connections``): a connection beyond it is closed at once, unread,
  so a flood of connections cannot take the process's file descriptors (its other ports, its
  store links and its HTTP users keep theirs). The cap is never above half the process's
  file-descriptor limit.

NOTE: the cap counts every client together. gRPC core has no per-address cap and Python's gRPC
exposes no accept hook (nor ``grpc_server_add_channel_from_fd``), so one address can fill it;
the deadline then frees its idle connections within ``grpc_handshake_timeout_s``, and a
refused client's channel reconnects (every 100-300 ms, :mod:`pdserve.grpcutil`). A
per-address cap in front of a port is the host firewall's (docs/security.md). The router's
HTTP port has its own per-address cap (:mod:`pdserve.http_edge`).

At start the process's soft ``RLIMIT_NOFILE`` is raised to its hard limit
(:func:`raise_fd_limit`): a default soft limit of 1,024 was what a flood of 1,100 idle
connections exhausted.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Any

from pdserve.config_fields import ConfigError, help_field

log = logging.getLogger(__name__)

#: Seconds a new connection has to finish its handshake and send its first HTTP/2 frames.
#: A TLS handshake on a busy 2-core machine takes well under a second; gRPC's own 120 s let
#: an idle connection hold a descriptor for two minutes.
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
#: Open connections one gRPC server accepts (each is a file descriptor; a pdserve cluster's
#: services hold a few each to one another).
DEFAULT_MAX_CONNECTIONS = 4096


@dataclass
class GrpcLimitsConfig:
    """The connection limits of every service config (a base class of each, through
    :class:`pdserve.identity.SecurityConfig`)."""

    grpc_max_connections: int = help_field(
        DEFAULT_MAX_CONNECTIONS,
        "open connections each gRPC port accepts, from all clients together; a further one is "
        "closed at once (0 = no cap; never above half the process's file-descriptor limit)",
        metavar="N",
    )
    grpc_handshake_timeout_s: float = help_field(
        DEFAULT_HANDSHAKE_TIMEOUT_S,
        "seconds a new gRPC connection has to finish its TLS handshake and send its first "
        "HTTP/2 frames; then it is closed (an idle TCP connection holds a descriptor that long)",
    )


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits one server is started with."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 0:
            raise ConfigError(
                f"grpc_max_connections must be >= 0 (0 = no cap), got {self.max_connections}"
            )
        if not self.handshake_timeout_s > 0:
            raise ConfigError(
                f"grpc_handshake_timeout_s must be positive, got {self.handshake_timeout_s}"
            )

    def effective_cap(self) -> int:
        """The cap applied: ``max_connections``, at most half the file-descriptor limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if not self.max_connections or soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft // 2))

    def options(self) -> list[tuple[str, Any]]:
        """gRPC core's server channel arguments for these limits."""
        options: list[tuple[str, Any]] = [
            ("grpc.server_handshake_timeout_ms", max(1, round(self.handshake_timeout_s * 1000)))
        ]
        cap = self.effective_cap()
        if cap:
            options.append(("grpc.max_allowed_incoming_connections", cap))
        return options


_limits = ConnectionLimits()


def limits() -> ConnectionLimits:
    """This process's limits (the defaults until :func:`configure`)."""
    return _limits


def configure(cfg: object) -> ConnectionLimits:
    """Sets this process's limits from ``cfg`` (a :class:`GrpcLimitsConfig`; anything else
    keeps the defaults) and raises its file-descriptor limit; once, at service start. Raises
    ConfigError naming a bad field."""
    global _limits
    if isinstance(cfg, GrpcLimitsConfig):
        _limits = ConnectionLimits(cfg.grpc_max_connections, cfg.grpc_handshake_timeout_s)
    raise_fd_limit()
    return _limits


def raise_fd_limit() -> int:
    """Raises the soft ``RLIMIT_NOFILE`` to the hard limit when it is lower; returns the soft
    limit now in force (the old one when the system refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("file-descriptor limit raised from %d to %d", soft, hard)
    return hard
