"""The trusted gateway's tenant header (services/router/gateway.py), without a network: who may
name a tenant, which tenants it may name, and the config checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.commands import certs
from pdserve.config import ConfigError
from pdserve.errors import PermissionDenied
from pdserve.identity import Identity
from pdserve.services.router import gateway
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.gateway import HEADER, Gateway
from pdserve.tenants import Tenants

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"
NGINX = Identity("gateway", "nginx")


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    path = tmp_path / "tenants"
    path.write_text(f"alpha {KA}\nbeta {KB}\n")
    return Tenants.load(str(path))


def test_a_configured_peer_names_a_tenant(tenants: Tenants) -> None:
    gw = Gateway.configured(tenants, HEADER, [], ["10.0.0.0/24", "fd00::7"])
    assert gw.tenant("alpha", "10.0.0.9", None) == "alpha"
    assert gw.tenant(" beta ", "fd00::7", None) == "beta"
    assert gw.tenant("alpha", "[fd00::7]", None) == "alpha"
    assert gw.tenant("alpha", "::ffff:10.0.0.3", None) == "alpha"  # IPv4 on a dual-stack socket
    assert gw.tenant(None, "10.0.0.9", None) is None  # no header: the key checks decide


@pytest.mark.parametrize("peer", ["10.0.1.9", "127.0.0.1", "fd00::8", "", "unix:/x"])
def test_the_header_from_any_other_peer_is_refused_naming_it(tenants: Tenants, peer) -> None:
    gw = Gateway.configured(tenants, HEADER, [], ["10.0.0.0/24", "fd00::7"])
    with pytest.raises(PermissionDenied, match="the x-pdserve-tenant header is taken only from"):
        gw.tenant("alpha", peer, None)
    assert gw.tenant(None, peer, None) is None


def test_a_gateway_certificate_names_a_tenant_from_any_address(tenants: Tenants) -> None:
    gw = Gateway.configured(tenants, HEADER, ["nginx", "envoy-1"], [])
    assert gw.tenant("alpha", "192.0.2.1", NGINX) == "alpha"
    assert gw.tenant("beta", "", Identity("gateway", "envoy-1")) == "beta"
    # the name alone is not enough: the role must be gateway; and the name must be listed
    for caller in (
        Identity("router", "nginx"),
        Identity("admin", "nginx"),
        Identity("gateway", "x"),
    ):
        with pytest.raises(PermissionDenied, match=re.escape(f"{caller} at 192.0.2.1 is none")):
            gw.tenant("alpha", "192.0.2.1", caller)


def test_a_gateway_may_name_only_the_tenants_of_the_file(tenants: Tenants) -> None:
    gw = Gateway.configured(tenants, HEADER, [], ["10.0.0.1"])
    for value in ("gamma", "", "ALPHA", KA):
        with pytest.raises(PermissionDenied, match="which is no tenant of this router's tenant"):
            gw.tenant(value, "10.0.0.1", None)


def test_no_gateway_configured_refuses_the_header_from_everyone(tenants: Tenants) -> None:
    gw = Gateway(tenants)
    with pytest.raises(PermissionDenied, match="x-pdserve-tenant"):
        gw.tenant("alpha", "127.0.0.1", NGINX)


def test_the_header_name_is_configurable(tenants: Tenants) -> None:
    gw = Gateway.configured(tenants, "x-team", [], ["127.0.0.1"])
    assert gw.http_tenant({"x-team": "alpha", HEADER: "beta"}, "127.0.0.1", None) == "alpha"
    assert gw.grpc_tenant({HEADER: "beta"}, "127.0.0.1", {}) is None


def test_certificates_are_read_from_the_connection(tenants: Tenants, tmp_path: Path) -> None:
    """gRPC's auth context and an HTTP connection's certificate: a gateway certificate of the
    cluster's CA proves the gateway; another role's, or none, does not."""
    certs.make(tmp_path, ["gateway:nginx"])
    gw = Gateway.configured(tenants, HEADER, ["nginx"], [])
    pem = (tmp_path / "nginx.crt").read_bytes()
    assert gw.grpc_tenant({HEADER: "alpha"}, "127.0.0.1", {"x509_pem_cert": [pem]}) == "alpha"
    with pytest.raises(PermissionDenied, match=re.escape("127.0.0.1 is none")):
        gw.grpc_tenant({HEADER: "alpha"}, "127.0.0.1", {})
    certs.make(tmp_path, ["router:nginx"])  # the same name, role router: no gateway
    router_pem = (tmp_path / "nginx.crt").read_bytes()
    with pytest.raises(PermissionDenied, match=re.escape("router:nginx at 127.0.0.1 is none")):
        gw.grpc_tenant({HEADER: "alpha"}, "127.0.0.1", {"x509_pem_cert": [router_pem]})
    with pytest.raises(PermissionDenied, match=re.escape("127.0.0.1 is none")):
        gw.grpc_tenant({HEADER: "alpha"}, "127.0.0.1", {"x509_pem_cert": [b"not a pem"]})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(header="X-Tenant"), "gateway_tenant_header 'X-Tenant' must be a lower-case"),
        (dict(header="authorization"), "nor one of authorization"),
        (dict(header="grpc-tenant"), "not grpc-\\* nor"),
        (dict(identities=["gateway:nginx"]), "must be a certificate's name \\(its CN\\) alone"),
        (dict(identities=[""]), "must be a certificate's name"),
        (dict(peers=["10.0.0.0/33"]), "gateway_peers: '10.0.0.0/33' is not an IP address"),
        (dict(peers=["gw.example"]), "gateway_peers: 'gw.example' is not"),
        (dict(peers=["10.0.0.1"], tenants_file=""), "need tenant_keys_file"),
        (dict(identities=["nginx"], public_tls=False), "takes mutual TLS on the public API"),
        (dict(identities=["nginx"], ca=""), "gateway_ca, else tls_ca"),
        (dict(identities=["nginx"], ca="/nonexistent/ca.crt"), "'/nonexistent/ca.crt': no such"),
    ],
)
def test_config_errors_say_what_is_wrong(fields: dict, message: str) -> None:
    args = dict(
        header=HEADER, identities=[], peers=[], tenants_file="t", public_tls=True, ca=__file__
    )
    args.update(fields)
    with pytest.raises(ConfigError, match=message):
        gateway.check_config(args.pop("header"), args.pop("identities"), args.pop("peers"), **args)


def test_router_config_checks_its_gateway_fields(tmp_path: Path) -> None:
    keys = tmp_path / "tenants"
    keys.write_text(f"alpha {KA}\n")
    base = dict(decode=["127.0.0.1:1"], tenant_keys_file=str(keys))
    RouterConfig(**base, gateway_peers=["127.0.0.1", "10.0.0.0/8"]).validate()
    with pytest.raises(ConfigError, match="gateway_peers: 'nope'"):
        RouterConfig(**base, gateway_peers=["nope"]).validate()
    with pytest.raises(ConfigError, match="gateway_identities takes mutual TLS"):
        RouterConfig(**base, gateway_identities=["nginx"]).validate()
    with pytest.raises(ConfigError, match="need tenant_keys_file"):
        RouterConfig(decode=["127.0.0.1:1"], gateway_peers=["127.0.0.1"]).validate()


def test_docs_show_the_nginx_config_the_tests_run() -> None:
    """docs/gateway.md carries deploy/nginx/pdserve.conf as it is (test_gateway_nginx.py runs
    that file): the page cannot drift from the tested configuration."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "gateway.md").read_text()
    block = doc.split("```nginx\n", 1)[1].split("```", 1)[0]
    assert block == (root / "deploy" / "nginx" / "pdserve.conf").read_text()
