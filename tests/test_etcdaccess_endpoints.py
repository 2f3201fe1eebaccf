"""etcd endpoints given by name (a compose or Kubernetes service, ``etcd:2379``) reach etcd:
etcd3aio dials an ``ipv4:`` target, which takes address literals only, so EtcdAccess resolves
the names when it makes a client, and keeps the name for the TLS check."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError
from pdserve.etcdaccess import EtcdAccess, ipv4_endpoint


def test_a_name_resolves_to_an_ipv4_literal_and_a_literal_stays():
    assert ipv4_endpoint("localhost:2379") == "127.0.0.1:2379"
    assert ipv4_endpoint("10.1.2.3:2379") == "10.1.2.3:2379"


def test_a_name_that_does_not_resolve_is_a_config_error():
    with pytest.raises(ConfigError, match=r"cannot resolve 'no-such-etcd\.invalid'"):
        ipv4_endpoint("no-such-etcd.invalid:2379")


def test_the_client_dials_the_address_and_checks_tls_against_the_name(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    client = EtcdAccess(("localhost:2379",)).client()
    assert client._manager.target == "ipv4:127.0.0.1:2379"
    tls = EtcdAccess(("localhost:2379",), ca=str(ca)).client()
    assert tls._tls_server_name == "localhost"
