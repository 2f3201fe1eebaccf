"""The KV masters' etcd link over TLS with a client certificate (what `pdserve up` runs: an
etcd that trusts only its own CA, whose client certificate is the masters'): the right
certificate elects and writes, a certificate of another CA and plaintext are refused with a
message that says where and how, and the settings are checked before anything connects."""

from __future__ import annotations

from pathlib import Path

import pytest
from etcd_harness import run_etcd

from pdserve.commands import certs
from pdserve.config import ConfigError
from pdserve.errors import Unavailable
from pdserve.etcdaccess import EtcdAccess
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.ha import EtcdLink, Leadership


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cert": "c.pem"}, "needs both ha_etcd_cert and ha_etcd_key"),
        ({"cert": "c.pem", "key": "k.pem"}, "ha_etcd_cert needs ha_etcd_ca"),
        ({"ca": "ca.pem", "endpoints": ("a:1", "b:2")}, "needs ha_etcd_server_name"),
        ({"password": "p"}, "ha_etcd_password needs ha_etcd_user"),
    ],
)
def test_etcd_settings_that_cannot_work_are_refused_naming_the_fields(fields, message):
    access = EtcdAccess(**{"endpoints": ("127.0.0.1:2379",), **fields}, fields="ha_etcd_")
    with pytest.raises(ConfigError, match=message):
        access.check()


def test_a_master_config_checks_its_etcd_settings():
    cfg = MasterConfig(port=50051, ha_etcd=["127.0.0.1:2379"], ha_etcd_cert="c.pem")
    with pytest.raises(ConfigError, match="ha_etcd_cert and ha_etcd_key"):
        cfg.validate()
    ok = MasterConfig(port=50051, ha_etcd=["127.0.0.1:2379"], ha_etcd_ca="ca.pem")
    ok.validate()
    assert ok.etcd_access().describe() == "127.0.0.1:2379 (TLS)"


def _access(endpoint: str, ca: Path, folder: Path, name: str) -> EtcdAccess:
    """``ca``'s CA certificate and ``name``'s certificate in ``folder``, for the masters."""
    return EtcdAccess(
        (endpoint,),
        ca=str(ca / "ca.crt"),
        cert=str(folder / f"{name}.crt"),
        key=str(folder / f"{name}.key"),
        fields="ha_etcd_",
    )


@pytest.mark.slow
@pytest.mark.etcd
def test_the_masters_etcd_link_takes_tls_with_a_client_certificate(tmp_path: Path):
    own = tmp_path / "etcd-certs"
    certs.make(own, ["meta:etcd", "master:kvstore-master"])
    other = tmp_path / "cluster-certs"
    certs.make(other, ["node:node-0"])
    for endpoint in run_etcd(tmp_path, own):
        link = EtcdLink(_access(endpoint, own, own, "kvstore-master"))
        try:
            lead = Leadership(link, "/t/", "127.0.0.1:1", 2, on_lost=lambda _why: None)
            link.call("campaign", lead.campaign())
            got = link.call("read", link.kv.get("/t/leader"))
            assert got.kvs[0].value == b"127.0.0.1:1"
        finally:
            link.close()
        with pytest.raises(Unavailable, match=rf"etcd at {endpoint} \(TLS\): connect failed"):
            EtcdLink(_access(endpoint, own, other, "node-0"))  # a certificate of another CA
        with pytest.raises(Unavailable, match="connect failed"):
            EtcdLink(EtcdAccess((endpoint,), fields="ha_etcd_"))  # plaintext
