"""Identities from certificates, ``pdserve certs``, TLS config and protected mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import identity
from pdserve.commands import certs
from pdserve.config import ConfigError
from pdserve.identity import Identity, SecurityConfig, TlsFiles
from pdserve.services.kvstore.master.config import MasterConfig


def test_certs_name_the_role_and_name_and_share_one_ca(tmp_path: Path):
    certs.make(tmp_path, ["node:node-0", "worker:prefill-0"], hosts=["10.0.0.7", "kv.example"])
    ca = (tmp_path / "ca.crt").read_bytes()
    certs.make(tmp_path, ["admin:ops"])  # later certificates reuse the CA
    assert (tmp_path / "ca.crt").read_bytes() == ca
    for name, want in [("node-0", Identity("node", "node-0")), ("ops", Identity("admin", "ops"))]:
        files = TlsFiles.load(
            *(str(tmp_path / f) for f in ("ca.crt", f"{name}.crt", f"{name}.key"))
        )
        assert files.identity() == want
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o777 == 0o600
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "node-0.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kv.example" in san.get_values_for_type(x509.DNSName)
    assert "node-0" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"10.0.0.7", "127.0.0.1"}


def test_a_ca_whose_key_is_not_kept_signs_once_and_is_gone(tmp_path: Path):
    """``pdserve up``'s certificates: a new CA each time, its key never on disk, leaf
    certificates valid for the days asked; a later run's CA does not accept the earlier one's."""
    import datetime

    from cryptography import x509

    (tmp_path / "ca.key").write_text("an earlier CA's key")
    first_ca = certs.Issuer.in_memory(tmp_path)
    first_ca.issue("node", "node-0", [], datetime.timedelta(days=3))
    assert not (tmp_path / "ca.key").exists()
    first = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((tmp_path / "node-0.crt").read_bytes())
    life = leaf.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=2.9) < life <= datetime.timedelta(days=3)
    leaf.verify_directly_issued_by(first)
    certs.Issuer.in_memory(tmp_path).issue("node", "node-1", [], datetime.timedelta(days=1))
    second = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    assert second.public_key() != first.public_key() and not (tmp_path / "ca.key").exists()
    with pytest.raises(Exception):  # noqa: B017 (cryptography raises several types)
        leaf.verify_directly_issued_by(second)


@pytest.mark.parametrize("bad", ["nobody:x", "node", "node:", "node:../x", "admin:ca"])
def test_certs_refuse_bad_identities(bad: str, tmp_path: Path):
    with pytest.raises(ValueError, match="identity"):
        certs.make(tmp_path, [bad])


@pytest.mark.slow
def test_the_certs_command_writes_files_and_explains_mistakes(tmp_path: Path):
    run = [sys.executable, "-m", "pdserve.commands.cli", "certs", "--out", str(tmp_path)]
    ok = subprocess.run([*run, "router:r1"], capture_output=True, text=True, check=True)
    assert "r1.crt" in ok.stdout and (tmp_path / "r1.key").exists()
    bad = subprocess.run([*run, "boss:x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "ROLE:NAME" in bad.stderr


def test_tls_config_must_be_complete_and_readable(tmp_path: Path):
    assert TlsFiles.load("", "", "") is None
    with pytest.raises(ConfigError, match="missing"):
        TlsFiles.load("ca.crt", "", "")
    (tmp_path / "ca.crt").write_text("x")
    with pytest.raises(ConfigError, match=r"tls_cert .*nope\.crt"):
        TlsFiles.load(str(tmp_path / "ca.crt"), str(tmp_path / "nope.crt"), str(tmp_path / "k"))


def test_a_certificate_without_a_pdserve_identity_is_refused_at_start(tmp_path: Path):
    """A CA-signed certificate whose OU is not a pdserve role fails when loaded, not per call."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    certs.make(tmp_path, ["admin:ops"])
    ca_cert = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "web")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(ca_cert.not_valid_before_utc)
        .not_valid_after(ca_cert.not_valid_after_utc)
        .sign(ca_key, hashes.SHA256())
    )
    (tmp_path / "web.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ConfigError, match="names no pdserve identity"):
        TlsFiles.load(
            str(tmp_path / "ca.crt"), str(tmp_path / "web.crt"), str(tmp_path / "ops.key")
        )


@pytest.mark.parametrize(
    ("host", "refused"),
    [("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True), ("", True)],
)
def test_protected_mode_refuses_an_exposed_bind_without_protection(host: str, refused: bool):
    cfg = MasterConfig(host=host)
    identity.configure_files(None)
    if refused:
        with pytest.raises(ConfigError, match="--insecure"):
            identity.check_exposure(cfg, "master")
    else:
        identity.check_exposure(cfg, "master")
    cfg.insecure = True
    identity.check_exposure(cfg, "master")


def test_protected_mode_accepts_tls_or_for_the_router_a_key(tmp_path: Path):
    certs.make(tmp_path, ["master:m"])
    cfg = SecurityConfig()
    cfg.host = "10.1.2.3"  # type: ignore[attr-defined]
    identity.configure_files(
        TlsFiles.load(*(str(tmp_path / f) for f in ("ca.crt", "m.crt", "m.key")))
    )
    try:
        identity.check_exposure(cfg, "master")
        with pytest.raises(ConfigError, match="API key"):
            identity.check_exposure(cfg, "router", has_key=False)
        identity.check_exposure(cfg, "router", has_key=True)
    finally:
        identity.configure_files(None)


@pytest.mark.slow
def test_an_exposed_service_without_tls_exits_with_the_reason(tmp_path: Path):
    cmd = [sys.executable, "-m", "pdserve.commands.cli", "kvstore", "master", "--host", "0.0.0.0"]
    cmd += ["--port", "0", "--state-dir", ""]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "reachable from other hosts" in out.stderr and "--insecure" in out.stderr


def test_advertised_address():
    assert identity.advertised(MasterConfig(host="0.0.0.0"), 5) == "127.0.0.1:5"
    assert identity.advertised(MasterConfig(host="0.0.0.0", advertise_host="kv"), 5) == "kv:5"
