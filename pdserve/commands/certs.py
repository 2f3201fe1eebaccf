"""``pdserve certs``: a development CA and one certificate per service identity.

``pdserve certs --out DIR role:name ...`` writes ``DIR/ca.crt`` (and ``ca.key``, kept to sign
more later) and, per identity, ``DIR/<name>.crt`` and ``DIR/<name>.key`` (mode 0600). A
certificate's subject is ``OU=<role>, CN=<name>`` (:mod:`pdserve.identity`), and its subject
alternative names cover localhost, 127.0.0.1, ::1, the name itself (a compose service name),
``<role>.role.pdserve`` (what a client that dials a master or meta expects) and every ``--host``: a peer dials ``host:port`` and checks the server certificate against
that host. An existing CA in ``DIR`` is reused, so certificates made later still join the
same cluster. For production, issue the same subjects from your own CA.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.identity import ROLES, role_name

CA_NAME = "pdserve dev CA"
#: Validity of a CA whose key stays in memory (:meth:`Issuer.in_memory`): it dies with the
#: process that holds the key, and the leaf certificates it issues are short-lived.
IN_MEMORY_CA_LIFETIME = datetime.timedelta(days=3650)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _write_atomic(path: Path, data: bytes, mode: int, owner: int | None = None) -> None:
    """Replaces ``path`` by a complete new file (a reader sees the old or the new bytes),
    belonging to user and group ``owner`` when given."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        if owner is not None:
            os.fchown(f.fileno(), owner, owner)
        f.write(data)
    os.replace(tmp, path)


def _key_bytes(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _make_ca(lifetime: datetime.timedelta):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


class Issuer:
    """A CA that issues identities into a folder (``<name>.crt``, ``<name>.key``)."""

    def __init__(self, out: Path, ca_cert, ca_key) -> None:
        self.out, self.ca_cert, self.ca_key = out, ca_cert, ca_key

    @classmethod
    def kept(cls, out: Path, days: int) -> Issuer:
        """``out``'s CA, else a new one valid ``days`` whose key is written next to it
        (``pdserve certs``: later runs sign more certificates for the same cluster)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        out.mkdir(parents=True, exist_ok=True)
        crt, key_path = out / "ca.crt", out / "ca.key"
        if crt.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(crt.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            return cls(out, cert, key)
        cert, key = _make_ca(datetime.timedelta(days=days))
        _write_atomic(key_path, _key_bytes(key), 0o600)
        crt.write_bytes(_pem(cert))
        return cls(out, cert, key)

    @classmethod
    def in_memory(cls, out: Path) -> Issuer:
        """A new CA whose key never touches the disk (``pdserve up``: its services run as
        the user that would read it). It lives as long as the process that holds it, which
        renews the certificates it issued; no one else can issue more of its identities."""
        out.mkdir(parents=True, exist_ok=True)
        (out / "ca.key").unlink(missing_ok=True)  # an earlier CA's key (an earlier version)
        cert, key = _make_ca(IN_MEMORY_CA_LIFETIME)
        _write_atomic(out / "ca.crt", _pem(cert), 0o644)
        return cls(out, cert, key)

    def issue(
        self,
        role: str,
        name: str,
        hosts: Sequence[str],
        lifetime: datetime.timedelta,
        owner: int | None = None,
    ) -> Path:
        """Writes (or replaces, each file whole) ``name``'s key and certificate, the key
        belonging to user ``owner`` when given; returns the certificate's path."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = _key()
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(name, list(hosts), role), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.ca_key, hashes.SHA256())
        )
        # key first: a reader between the two writes finds a pair that does not match and
        # keeps its current one (pdserve.identity), never a new certificate with an old key
        _write_atomic(self.out / f"{name}.key", _key_bytes(key), 0o600, owner)
        path = self.out / f"{name}.crt"
        _write_atomic(path, _pem(cert), 0o644)
        return path


def _san(name: str, hosts: list[str], role: str):
    from cryptography import x509

    entries: list = []
    for host in ["localhost", "127.0.0.1", "::1", name, role_name(role), *hosts]:
        try:
            entry = x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
        except ValueError:
            entry = x509.DNSName(host)
        if entry not in entries:
            entries.append(entry)
    return x509.SubjectAlternativeName(entries)


def parse_identity(text: str) -> tuple[str, str]:
    """``role:name`` -> (role, name), with a ValueError that says what is wrong."""
    role, sep, name = text.partition(":")
    if not sep or not name or role not in ROLES:
        raise ValueError(f"identity {text!r} must be ROLE:NAME with ROLE one of {', '.join(ROLES)}")
    if "/" in name or name.startswith(".") or name == "ca":
        raise ValueError(f"identity {text!r}: the name becomes a file name; pick another")
    return role, name


def make(
    out: Path, identities: list[str], hosts: Sequence[str] = (), days: int = 365
) -> list[Path]:
    """Writes the CA (unless ``out`` has one, key included) and a certificate and key per
    ``role:name``, valid for ``days``; returns the certificate paths."""
    parsed = [parse_identity(i) for i in identities]
    issuer = Issuer.kept(out, days)
    return [issuer.issue(r, n, hosts, datetime.timedelta(days=days)) for r, n in parsed]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs",
        help="make a development CA and per-service TLS certificates",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "identities",
        nargs="+",
        metavar="ROLE:NAME",
        help=f"identities to issue; ROLE is one of {', '.join(ROLES)} (e.g. node:node-0)",
    )
    p.add_argument("--out", default="certs", help="output folder (default: %(default)s)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        dest="hosts",
        help="extra host name or IP address the certificates are valid for (repeatable)",
    )
    p.add_argument("--days", type=int, default=365, help="validity (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        paths = make(Path(args.out), args.identities, args.hosts, args.days)
    except ValueError as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    print(f"CA: {Path(args.out) / 'ca.crt'}")
    for p in paths:
        print(f"issued {p} (key {p.with_suffix('.key')})")
    return 0
