"""Who runs as which user in the compose lab (issue 56, isolation by default), checked without
Docker: every container that holds a key runs as a user of its own (one per TLS identity: the
two KV masters share theirs), the certs job gives each key to exactly that user (its
``--key-owner`` pairs follow the services' ``user:``, so the file cannot drift) and keeps the CA
key and admin.key, as root with CHOWN its only capability; every volume a service writes is
writable by its user; and, as root here, the certs job's own command line makes a folder in
which each service's user reads its own key and no other."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from pdserve.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_TEXT = (DEPLOY / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
CERTS = "/etc/pdserve/certs"
#: the image's own user (deploy/Dockerfile): it owns the image's folders, no service runs as it
IMAGE_USER = 10001


def _key_holders() -> dict[str, str]:
    """{service: the file name of the key it holds} for every container with a key."""
    holders = {}
    for name, svc in SERVICES.items():
        if name == "certs":
            continue
        env = svc.get("environment", {})
        if svc.get("image") == "pdserve:cpu":
            argv = shlex.split(svc["command"])
            key = argv[argv.index("--tls-key") + 1]
        elif "GATEWAY_KEY" in env:
            key = env["GATEWAY_KEY"]
        else:
            continue
        assert key.startswith(CERTS + "/") and key.endswith(".key"), (name, key)
        holders[name] = Path(key).stem
    return holders


def _uid(name: str) -> int:
    """The numeric user a service runs as, ``UID:GID`` with the same number twice."""
    user = str(SERVICES[name]["user"])
    m = re.fullmatch(r"(\d+):(\d+)", user)
    assert m and m[1] == m[2], f"{name}: user {user!r} is not UID:UID (numeric, its own group)"
    return int(m[1])


def _certs_args():
    args = build_parser().parse_args(shlex.split(SERVICES["certs"]["command"]))
    assert args.out == CERTS
    return args


def test_every_pdserve_container_and_the_gateway_hold_a_key():
    pdserve = {n for n, s in SERVICES.items() if s.get("image") == "pdserve:cpu"} - {"certs"}
    assert set(_key_holders()) == pdserve | {"gateway"}


def test_each_identity_runs_as_a_user_of_its_own():
    holders = _key_holders()
    by_key: dict[str, set[int]] = {}
    for name, key in holders.items():
        by_key.setdefault(key, set()).add(_uid(name))
    # one user per identity: the services that share a key (the two masters) share it
    assert all(len(uids) == 1 for uids in by_key.values()), by_key
    users = [next(iter(u)) for u in by_key.values()]
    assert len(set(users)) == len(users), f"two identities share a user: {by_key}"
    shared = {n for n, k in holders.items() if list(holders.values()).count(k) > 1}
    assert shared == {"kvstore-master", "kvstore-master-1"}, shared
    # no key holder runs as root, as the image's user, or as any container without its key
    others = {
        n: str(s.get("user", "")).split(":")[0] for n, s in SERVICES.items() if n not in holders
    }
    for name in holders:
        uid = _uid(name)
        assert uid not in (0, IMAGE_USER), (name, uid)
        assert str(uid) not in others.values(), (name, uid, others)
    # the table in the file's header names every one of them
    header = COMPOSE_TEXT.split("\nx-pdserve:", 1)[0]
    for name in holders:
        assert re.search(rf"#\s+.*\b{_uid(name)}\b.*\b{re.escape(name)}\b", header), name


def test_the_certs_job_gives_each_key_to_its_services_user_and_keeps_the_rest():
    certs = SERVICES["certs"]
    assert str(certs["user"]) == "0:0"  # root, to chown ...
    assert certs["cap_drop"] == ["ALL"] and certs["cap_add"] == ["CHOWN"]  # ... and no more
    args = _certs_args()
    owners = dict(o.split("=", 1) for o in args.key_owners)
    assert len(owners) == len(args.key_owners), "a key given twice"
    expected = {key: str(_uid(name)) for name, key in _key_holders().items()}
    assert owners == expected
    issued = {i.split(":", 1)[1] for i in args.identities}
    # every identity issued is held by a service, except admin's: it stays root's, with the CA's
    assert issued - set(owners) == {"admin"}, issued - set(owners)


def test_every_service_reads_the_certs_volume_read_only_and_writes_only_its_own_volumes():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (sticky,) = re.findall(r"chmod 1777 ([^\n]+)", dockerfile)
    sticky_dirs = set(sticky.split())
    tools = (DEPLOY / "lab" / "Dockerfile.tools").read_text()
    (owned,) = re.findall(r"chown 65534:65534 ([^#\n]+)", tools)
    nobody_dirs = set(owned.split())
    named = set(COMPOSE["volumes"])
    for name, svc in SERVICES.items():
        for mount in svc.get("volumes", []):
            source, target, *mode = mount.split(":")
            if source not in named:
                assert mode == ["ro"], (name, mount)  # a file of the checkout: read-only
                continue
            if source == "certs":
                assert mode == (["ro"] if name != "certs" else []), (name, mount)
                continue
            assert not mode, (name, mount)
            # a volume starts as a copy of the image's folder: one its user may write
            if svc["image"] == "pdserve:cpu":
                assert target in sticky_dirs, (name, target, sticky_dirs)
            elif svc["image"] == "pdserve-lab-tools:bookworm":
                assert str(svc["user"]) == "65534:65534" and target in nobody_dirs, (name, target)
            else:  # grafana: its image's own user and folder
                assert (name, target) == ("grafana", "/var/lib/grafana"), (name, target)


def test_the_pdserve_services_have_a_writable_home():
    for name in _key_holders():
        if SERVICES[name]["image"] == "pdserve:cpu":  # no passwd entry: HOME would be /
            assert SERVICES[name]["environment"]["HOME"] == "/tmp", name


def _reads(path: Path, uid: int) -> bool:
    res = subprocess.run(
        ["head", "-c", "1", str(path)], user=uid, group=uid, extra_groups=[], capture_output=True
    )
    assert res.returncode == 0 or b"Permission denied" in res.stderr, res.stderr
    return res.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the certs job gives keys away: root only")
@pytest.mark.slow  # a process per read, as each user
def test_in_the_volume_the_certs_job_writes_each_user_reads_its_own_key_alone():
    base = Path(tempfile.mkdtemp(prefix="pdserve-lab-certs-", dir="/tmp"))
    try:
        base.chmod(0o755)  # others may enter, as the volume's mount point
        args = _certs_args()
        args.out = str(base / "certs")
        assert args.func(args) == 0
        out = Path(args.out)
        keys = sorted(out.glob("*.key"))
        for name, key in _key_holders().items():
            uid = _uid(name)
            readable = {p.stem for p in keys if _reads(p, uid)}
            assert readable == {key}, (name, uid, readable)
            assert _reads(out / "ca.crt", uid) and _reads(out / f"{key}.crt", uid), name
        st = (out / "ca.key").stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    finally:
        shutil.rmtree(base)
