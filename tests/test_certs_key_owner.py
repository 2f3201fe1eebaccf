"""``pdserve certs --key-owner NAME=UID``: each identity's key belongs to the one user that runs
its service (mode 0600), certificates stay world-readable, and the CA key, the keys not named
(admin) and the folder stay the running user's (root: only root may give a file away). The
compose lab's certs job runs it this way (tests/deploy/test_lab_users.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pdserve.commands import certs
from pdserve.commands.cli import build_parser

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="giving keys away takes root (chown)")
IDENTITIES = ["meta:meta", "node:node-0", "worker:prefill-0", "admin:admin"]
OWNERS = ["meta=10010", "node-0=10030", "prefill-0=10040"]


@pytest.fixture
def out() -> Iterator[Path]:
    """A folder other users can reach (pytest's own tmp folders are root's, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="pdserve-certs-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base / "certs"
    finally:
        shutil.rmtree(base)


def _owner_mode(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def _reads(path: Path, uid: int) -> bool:
    """Whether user ``uid`` (group ``uid``, no other groups) can read ``path``."""
    # head, not this Python: the venv's interpreter may sit in root's home
    res = subprocess.run(
        ["head", "-c", "1", str(path)], user=uid, group=uid, extra_groups=[], capture_output=True
    )
    assert res.returncode == 0 or b"Permission denied" in res.stderr, res.stderr
    return res.returncode == 0


@root_only
def test_each_key_belongs_to_its_owner_and_the_rest_to_root(out: Path):
    paths = certs.make(out, IDENTITIES, ["meta"], days=2, key_owners=OWNERS)
    assert [p.name for p in paths] == ["meta.crt", "node-0.crt", "prefill-0.crt", "admin.crt"]
    assert _owner_mode(out) == (0, 0, 0o755)
    assert _owner_mode(out / "ca.key") == (0, 0, 0o600)
    assert _owner_mode(out / "admin.key") == (0, 0, 0o600)
    assert stat.S_IMODE((out / "ca.crt").stat().st_mode) == 0o644
    owners = {"meta": 10010, "node-0": 10030, "prefill-0": 10040}
    for name, uid in owners.items():
        assert _owner_mode(out / f"{name}.key") == (uid, uid, 0o600), name
        assert stat.S_IMODE((out / f"{name}.crt").stat().st_mode) == 0o644, name
        # the bytes: a key that matches its certificate, signed by the CA
        key = serialization.load_pem_private_key((out / f"{name}.key").read_bytes(), None)
        cert = x509.load_pem_x509_certificate((out / f"{name}.crt").read_bytes())
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
        ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
    assert not list(out.glob(".*.tmp"))


@root_only
@pytest.mark.slow  # a process per read, as each user
def test_each_owner_reads_its_own_key_and_no_other(out: Path):
    certs.make(out, IDENTITIES, days=2, key_owners=OWNERS)
    owners = {"meta": 10010, "node-0": 10030, "prefill-0": 10040}
    # as each owner: its own key and every certificate, no other key, not the CA's or admin's
    for name, uid in owners.items():
        keys = {p.stem for p in out.glob("*.key") if _reads(p, uid)}
        assert keys == {name}, (name, keys)
        assert all(_reads(p, uid) for p in out.glob("*.crt")), name


@root_only
def test_a_rerun_keeps_the_ca_and_takes_back_what_an_earlier_job_left(out: Path):
    # a volume an earlier, unprivileged job wrote: the folder, the CA key and admin's its own
    certs.make(out, IDENTITIES, days=2)
    ca = (out / "ca.crt").read_bytes()
    for path in (out, out / "ca.key", out / "ca.crt", out / "admin.key"):
        os.chown(path, 10001, 10001)
    (out / "ca.key").chmod(0o640)
    old_meta_key = (out / "meta.key").read_bytes()
    certs.make(out, IDENTITIES, days=2, key_owners=OWNERS)
    assert (out / "ca.crt").read_bytes() == ca  # the same CA: the cluster keeps its trust
    assert _owner_mode(out) == (0, 0, 0o755)
    assert _owner_mode(out / "ca.key") == (0, 0, 0o600)
    assert _owner_mode(out / "ca.crt") == (0, 0, 0o644)
    assert _owner_mode(out / "admin.key") == (0, 0, 0o600)
    assert _owner_mode(out / "meta.key") == (10010, 10010, 0o600)
    assert (out / "meta.key").read_bytes() != old_meta_key  # re-issued, a new file


@root_only
def test_the_command_line(out: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["certs", "--out", str(out), "meta:meta", "admin:admin", "--key-owner", "meta=10010"]
    args = build_parser().parse_args(argv)
    assert args.key_owners == ["meta=10010"]
    assert args.func(args) == 0
    assert _owner_mode(out / "meta.key") == (10010, 10010, 0o600)
    assert _owner_mode(out / "admin.key") == (0, 0, 0o600)
    args = build_parser().parse_args([*argv, "--key-owner", "ca=10010"])
    assert args.func(args) == 2
    assert "no identity named 'ca' is issued" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("owners", "message"),
    [
        (["meta"], "must be NAME=UID"),
        (["meta="], "must be NAME=UID"),
        (["=10010"], "must be NAME=UID"),
        (["router=10010"], "no identity named 'router' is issued (issued: meta, admin)"),
        (["ca=0"], "no identity named 'ca'"),
        (["meta=10010", "meta=10011"], "'meta' already has an owner"),
        (["meta=pdserve"], "UID must be a number"),
        (["meta=-1"], "UID must be a number"),
        (["meta=4294967295"], "UID must be a number"),
    ],
)
def test_bad_key_owners_are_refused_before_anything_is_written(
    tmp_path: Path, owners: list[str], message: str
):
    with pytest.raises(ValueError, match="--key-owner") as err:
        certs.make(tmp_path / "c", ["meta:meta", "admin:admin"], key_owners=owners)
    assert message in str(err.value)
    assert not (tmp_path / "c").exists()


def test_only_root_gives_keys_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=r"user\(s\) 10010: only root may"):
        certs.make(tmp_path / "c", ["meta:meta"], key_owners=["meta=10010"])
    assert not (tmp_path / "c").exists()
    # naming the running user itself needs no root
    assert certs.parse_key_owners(["meta=1000"], ["meta"]) == {"meta": 1000}
