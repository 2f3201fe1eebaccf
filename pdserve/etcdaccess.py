"""How pdserve's etcd clients reach etcd: the endpoints, TLS (etcd's CA, and a client
certificate for an etcd started with ``--client-cert-auth``) and an etcd user. Meta's etcd
backend and the KV masters' election (``services/kvstore/master/ha.py``) both take one
:class:`EtcdAccess`: one set of checks, one way to make the client."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError

#: How often an etcd user's token is renewed (seconds), below etcd's default token TTL of 300.
TOKEN_REFRESH_S = 240.0


def _read(field_name: str, path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field_name} {path!r}: {exc.strerror or exc}") from exc


def ipv4_endpoint(endpoint: str) -> str:
    """``host:port`` with the host resolved to an IPv4 address: etcd3aio dials an ``ipv4:``
    target, which takes address literals only (a container or Kubernetes service name such as
    ``etcd:2379`` fails with "the target uri is not valid"). Resolved when a client is made.
    ConfigError when the name does not resolve."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        return endpoint
    try:
        ipaddress.IPv4Address(host)
        return endpoint
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"etcd endpoint {endpoint!r}: cannot resolve {host!r}: {exc}") from exc
    return f"{infos[0][4][0]}:{port}"


@dataclass(frozen=True)
class EtcdAccess:
    """``ca``, ``cert``, ``key``: PEM file paths ("" = none; ``ca`` turns TLS on);
    ``server_name``: the name checked in etcd's server certificates (needed with several
    endpoints: gRPC checks one name for all); ``user``/``password``: etcd auth.
    ``fields``: the config fields' prefix, for messages (``etcd_``, ``ha_etcd_``)."""

    endpoints: tuple[str, ...]
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    user: str = ""
    password: str = ""
    fields: str = "etcd_"

    def check(self) -> None:
        """ConfigError naming the fields when the settings cannot work together."""
        f = self.fields
        if (self.cert or self.key) and not (self.cert and self.key):
            raise ConfigError(f"an etcd client certificate needs both {f}cert and {f}key")
        if self.cert and not self.ca:
            raise ConfigError(f"{f}cert needs {f}ca (the CA of etcd's server certificate)")
        if self.ca and len(self.endpoints) > 1 and not self.server_name:
            raise ConfigError(
                f"TLS to several etcd endpoints needs {f}server_name: a host name every etcd "
                "server certificate carries"
            )
        if self.password and not self.user:
            raise ConfigError(f"{f}password needs {f}user")

    def client(self) -> Any:
        """An etcd3aio client (not connected yet); reads the PEM files now."""
        from etcd3aio import Etcd3Client

        f = self.fields
        tls = {}
        if self.ca:
            tls = {
                "ca_cert": _read(f"{f}ca", self.ca),
                "cert_chain": _read(f"{f}cert", self.cert),
                "cert_key": _read(f"{f}key", self.key),
            }
        server_name = self.server_name
        if self.ca and not server_name and len(self.endpoints) == 1:
            host = self.endpoints[0].rpartition(":")[0]
            if ipv4_endpoint(self.endpoints[0]) != self.endpoints[0]:
                server_name = host  # the name the dialled address no longer carries
        return Etcd3Client(
            [ipv4_endpoint(e) for e in self.endpoints],
            rpc_max_attempts=2,
            tls_server_name=server_name or None,
            **tls,
        )

    async def authenticate(self, client: Any, stack: contextlib.AsyncExitStack, timeout: float):
        """With a user: authenticates ``client`` and keeps its token fresh until ``stack``
        closes."""
        if self.user:
            refresher = client.token_refresher(self.user, self.password, interval=TOKEN_REFRESH_S)
            await asyncio.wait_for(stack.enter_async_context(refresher), timeout)

    def describe(self) -> str:
        """Where and how, for messages: ``host:port,... (TLS, as user U)``."""
        how = [w for w, on in (("TLS", self.ca), (f"as user {self.user!r}", self.user)) if on]
        return ",".join(self.endpoints) + (f" ({', '.join(how)})" if how else "")
