"""Trusted gateway identity: the caller's tenant taken from a header a gateway sets.

A platform runs pdserve behind its own gateway (nginx, Envoy), which authenticates callers its
own way and says who they are in one header, ``x-pdserve-tenant`` by default
(``gateway_tenant_header``). The router believes that header only from a gateway that proves
itself:

- mutual TLS: the connection presents a client certificate signed by ``gateway_ca`` (else the
  router's ``tls_ca``) whose subject is ``OU=gateway, CN=<name>`` (:mod:`pdserve.identity`;
  ``pdserve certs gateway:<name>`` makes one) with ``<name>`` in ``gateway_identities``; or
- its address: the connection comes from an address in ``gateway_peers`` (addresses or CIDRs).

A header from anyone else is refused (HTTP 403, gRPC PERMISSION_DENIED, the message naming the
header), never ignored: a client that forged it learns so at once. The tenant named must be one
of the tenants file's (:mod:`pdserve.tenants`), else 403 naming it. An accepted request is that
tenant's exactly as if it had presented the tenant's own API key (cache salt, abort scope,
in-flight cap): :data:`pdserve.tenants.current` is set, and the rest of the router sees no
difference. A gateway's request without the header takes the key checks as any other.

:class:`Gateway` is the decision, a plain class; :meth:`Gateway.http_tenant` and
:meth:`Gateway.grpc_tenant` read a request's header, peer address and certificate for it.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError
from pdserve.errors import PermissionDenied
from pdserve.identity import Identity, identity_of_der, identity_of_pem
from pdserve.tenants import Tenants

#: The default header that names the caller's tenant (``gateway_tenant_header``).
HEADER = "x-pdserve-tenant"
#: The certificate role (subject OU) of a gateway identity.
ROLE = "gateway"
_TOKEN = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
#: Headers a gateway header may not be: the key checks', HTTP/2's and gRPC's own.
_RESERVED = ("authorization", "x-api-key", "host", "content-type", "te", "user-agent")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_peers(entries: Iterable[str]) -> tuple[Network, ...]:
    """``gateway_peers`` as networks (an address is a /32 or /128); a ConfigError names the
    entry that is neither."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ConfigError(
                f"gateway_peers: {entry!r} is not an IP address or CIDR (e.g. 10.0.0.7, "
                "10.0.0.0/24, fd00::/64)"
            ) from None
    return tuple(out)


def check_config(
    header: str,
    identities: list[str],
    peers: list[str],
    *,
    tenants_file: str,
    public_tls: bool,
    ca: str,
) -> None:
    """ConfigError unless the router's gateway fields make sense together: a header name that
    is an HTTP token in lower case and none of the key checks'; identity names without a role;
    peers that parse; and, once a gateway is configured, a tenants file to name (``ca``: the CA
    that would verify gateway certificates, gateway_ca or tls_ca)."""
    if not _TOKEN.match(header) or header in _RESERVED or header.startswith(("grpc-", ":")):
        raise ConfigError(
            f"gateway_tenant_header {header!r} must be a lower-case header name of letters, "
            f"digits and '-' (1-64), not grpc-* nor one of {', '.join(_RESERVED)}"
        )
    for name in identities:
        if not name or ":" in name or name != name.strip():
            raise ConfigError(
                f"gateway_identities: {name!r} must be a certificate's name (its CN) alone; "
                f"the certificate's role (OU) must be {ROLE!r}"
            )
    parse_peers(peers)
    if not (identities or peers):
        return
    if not tenants_file:
        raise ConfigError(
            "gateway_identities / gateway_peers need tenant_keys_file: the gateway's "
            f"{header} header names one of its tenants"
        )
    if identities and not (public_tls and ca):
        raise ConfigError(
            "gateway_identities takes mutual TLS on the public API: give public_tls_cert, "
            "public_tls_key and the CA of the gateways' certificates (gateway_ca, else tls_ca)"
        )
    if identities and not Path(ca).expanduser().is_file():
        raise ConfigError(f"gateway_ca (else tls_ca) {ca!r}: no such file")


@dataclass(frozen=True)
class Gateway:
    """Who may name a tenant in :attr:`header`, and the tenants it may name. With neither
    identities nor peers no one may: the header is refused from everyone."""

    tenants: Tenants
    header: str = HEADER
    #: Names (CN) of the gateway certificates (role :data:`ROLE`) that are trusted.
    identities: frozenset[str] = frozenset()
    #: Addresses the trusted gateways connect from.
    peers: tuple[Network, ...] = ()

    @classmethod
    def configured(
        cls, tenants: Tenants, header: str, identities: Iterable[str], peers: Iterable[str]
    ) -> Gateway:
        """From the router's ``gateway_*`` fields (checked by :func:`check_config`)."""
        return cls(tenants, header, frozenset(identities), parse_peers(peers))

    def proven(self, peer: str, caller: Identity | None) -> bool:
        """Whether a connection from address ``peer`` presenting ``caller``'s certificate (None:
        none, or not a pdserve identity) is a trusted gateway."""
        if caller is not None and caller.role == ROLE and caller.name in self.identities:
            return True
        try:
            address = ipaddress.ip_address(peer.strip("[]"))
        except ValueError:
            return False  # a unix socket or no address: never a configured peer
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in net for net in self.peers)

    def tenant(self, value: str | None, peer: str, caller: Identity | None) -> str | None:
        """The tenant a request names in :attr:`header` (``value``; None = the request has no
        such header, and the key checks decide); PermissionDenied, saying why, when the
        connection is no trusted gateway or the name is no tenant's."""
        if value is None:
            return None
        if not self.proven(peer, caller):
            who = f"{caller} at {peer}" if caller is not None else peer or "this peer"
            raise PermissionDenied(
                f"the {self.header} header is taken only from a trusted gateway (router "
                f"gateway_identities / gateway_peers), and {who} is none: remove the header "
                "and present an API key"
            )
        name = value.strip()
        if name and name in self.tenants.by_digest.values():
            return name
        raise PermissionDenied(
            f"the {self.header} header names {name[:80]!r}, which is no tenant of this "
            "router's tenant_keys_file"
        )

    def http_tenant(self, headers: Mapping[str, str], remote: str, ssl_object: Any) -> str | None:
        """:meth:`tenant` for an HTTP request: its headers, its peer address and its
        connection's ``ssl_object`` (None on plaintext)."""
        caller = None
        if isinstance(ssl_object, ssl.SSLObject | ssl.SSLSocket):
            der = ssl_object.getpeercert(binary_form=True)
            caller = _identity(identity_of_der, der) if der else None
        return self.tenant(headers.get(self.header), remote, caller)

    def grpc_tenant(self, metadata: Mapping[str, str], peer: str, auth: Mapping) -> str | None:
        """:meth:`tenant` for a gRPC call: its metadata, its peer address and its
        ``context.auth_context()`` (the verified client certificate, if any)."""
        pems = auth.get("x509_pem_cert")
        caller = _identity(identity_of_pem, pems[0]) if pems else None
        return self.tenant(metadata.get(self.header), peer, caller)


def _identity(parse: Any, cert: bytes) -> Identity | None:
    """The pdserve identity a certificate names; None for one that names none (a client's own
    certificate from the same CA proves nothing here)."""
    try:
        return parse(cert)
    except (ConfigError, ValueError):
        return None
