"""``pdserve certs``: a development CA and one certificate per service identity.

``pdserve certs --out DIR role:name ...`` writes ``DIR/ca.crt`` (and ``ca.key``, kept to sign
more later) and, per identity, ``DIR/<name>.crt`` and ``DIR/<name>.key`` (mode 0600). A
certificate's subject is ``OU=<role>, CN=<name>`` (:mod:`pdserve.identity`), and its subject
alternative names cover localhost, 127.0.0.1, ::1, the name itself (a compose service name),
``<role>.role.pdserve`` (what a client that dials a master or meta expects) and every ``--host``: a peer dials ``host:port`` and checks the server certificate against
that host. An existing CA in ``DIR`` is reused, so certificates made later still join the
same cluster. For production, issue the same subjects from your own CA.

Keys belong to the user who runs the command, unless ``--key-owner NAME=UID`` gives identity
NAME's key to user UID (group UID too; still mode 0600), so that a service running as UID reads
its own key and no other (the compose lab: each service is a user of its own). Giving a key
away takes root (chown); the CA key, and every key not named, then stay root's (0600), and
``DIR`` becomes root's (mode 0755: certificates stay readable by everyone, no one else can
replace a file in it).
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
    def kept(cls, out: Path, days: int, take_key: bool = False) -> Issuer:
        """``out``'s CA, else a new one valid ``days`` whose key is written next to it
        (``pdserve certs``: later runs sign more certificates for the same cluster);
        ``take_key``: a kept CA becomes this user's, its key readable by it alone (:func:`_own`)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        out.mkdir(parents=True, exist_ok=True)
        crt, key_path = out / "ca.crt", out / "ca.key"
        if crt.exists() and key_path.exists():
            if take_key:
                _own(key_path, 0o600)
                _own(crt, 0o644)
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


def _own(path: Path, mode: int) -> None:
    """Makes ``path`` (the kept CA's key or certificate) this user's, with ``mode``, taking it
    over as root from whoever wrote it (a volume an earlier, unprivileged job wrote)."""
    if os.geteuid() == 0:
        os.chown(path, os.geteuid(), os.getegid())
    if path.stat().st_uid == os.geteuid():
        os.chmod(path, mode)


def parse_key_owners(texts: Sequence[str], names: Sequence[str]) -> dict[str, int]:
    """``NAME=UID`` (``--key-owner``) -> {name: uid}, with a ValueError that says what is
    wrong: NAME must be one of ``names`` (the identities issued), named once; UID a number."""
    owners: dict[str, int] = {}
    for text in texts:
        name, sep, uid = text.partition("=")
        if not sep or not name or not uid:
            raise ValueError(f"--key-owner {text!r} must be NAME=UID (e.g. meta=10010)")
        if name not in names:
            listed = ", ".join(names) or "none"
            raise ValueError(
                f"--key-owner {text!r}: no identity named {name!r} is issued (issued: {listed}); "
                "the CA key stays with the user running the command"
            )
        if name in owners:
            raise ValueError(f"--key-owner {text!r}: {name!r} already has an owner")
        if not uid.isdigit() or int(uid) > 2**32 - 2:
            raise ValueError(f"--key-owner {text!r}: UID must be a number (a user id), not {uid!r}")
        owners[name] = int(uid)
    foreign = sorted({u for u in owners.values() if u != os.geteuid()})
    if foreign and os.geteuid() != 0:
        raise ValueError(
            f"--key-owner gives keys to user(s) {', '.join(map(str, foreign))}: only root may "
            "(run the command as root, e.g. the compose lab's certs job)"
        )
    return owners


def _own_folder(out: Path) -> None:
    """``out`` belongs to this user, mode 0755: no other user can replace a file in it."""
    out.mkdir(parents=True, exist_ok=True)
    st = out.stat()
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        os.chown(out, os.geteuid(), os.getegid())
    os.chmod(out, 0o755)


def parse_identity(text: str) -> tuple[str, str]:
    """``role:name`` -> (role, name), with a ValueError that says what is wrong."""
    role, sep, name = text.partition(":")
    if not sep or not name or role not in ROLES:
        raise ValueError(f"identity {text!r} must be ROLE:NAME with ROLE one of {', '.join(ROLES)}")
    if "/" in name or name.startswith(".") or name == "ca":
        raise ValueError(f"identity {text!r}: the name becomes a file name; pick another")
    return role, name


def make(
    out: Path,
    identities: list[str],
    hosts: Sequence[str] = (),
    days: int = 365,
    key_owners: Sequence[str] = (),
) -> list[Path]:
    """Writes the CA (unless ``out`` has one, key included) and a certificate and key per
    ``role:name``, valid for ``days``, each key belonging to its ``NAME=UID`` of
    ``key_owners`` when named there (:func:`parse_key_owners`); returns the certificate paths."""
    parsed = [parse_identity(i) for i in identities]
    owners = parse_key_owners(key_owners, [n for _, n in parsed])
    if owners:  # keys given away: the folder and the CA key are this user's alone
        _own_folder(out)
    issuer = Issuer.kept(out, days, take_key=bool(owners))
    life = datetime.timedelta(days=days)
    return [issuer.issue(r, n, hosts, life, owners.get(n)) for r, n in parsed]


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
    p.add_argument(
        "--key-owner",
        action="append",
        default=[],
        dest="key_owners",
        metavar="NAME=UID",
        help="identity NAME's key belongs to user (and group) UID, mode 0600: the one user "
        "that runs that service (repeatable; needs root, which then keeps the CA key)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        paths = make(Path(args.out), args.identities, args.hosts, args.days, args.key_owners)
    except ValueError as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    print(f"CA: {Path(args.out) / 'ca.crt'}")
    for p in paths:
        print(f"issued {p} (key {p.with_suffix('.key')})")
    return 0
