"""``pdserve etcd``: the etcd member ``pdserve up --kvstore-masters N`` runs as a service."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.commands import etcd
from pdserve.commands.cli import build_parser


def test_the_member_listens_where_asked_and_compacts():
    cmd = etcd.command("/usr/bin/etcd", "/data", "127.0.0.1", 50090, 50091)
    assert cmd[0] == "/usr/bin/etcd"
    assert {
        "--data-dir=/data",
        "--listen-client-urls=http://127.0.0.1:50090",
        "--advertise-client-urls=http://127.0.0.1:50090",
        "--listen-peer-urls=http://127.0.0.1:50091",
        "--initial-cluster=pdserve=http://127.0.0.1:50091",
        "--auto-compaction-retention=1",
    } <= set(cmd)


def test_without_the_binary_it_says_what_to_install(monkeypatch, tmp_path: Path, capsys):
    monkeypatch.setattr(etcd, "binary", lambda: None)
    args = build_parser().parse_args(["etcd", "--data-dir", str(tmp_path / "d")])
    assert args.func(args) == 1
    assert "apt-get install etcd-server" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_it_serves_and_stops_with_its_etcd(tmp_path: Path):
    from pdserve.procs import free_ports, service_args, start_service

    if etcd.binary() is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    port, peer = free_ports(2)
    proc = start_service(
        "etcd",
        service_args("etcd", data_dir=tmp_path / "data", port=port, peer_port=peer),
        tmp_path,
        timeout=30,
    )
    try:
        assert proc.info["client"] == f"127.0.0.1:{port}"
        assert etcd.healthy(proc.info["client"])
        child = proc.info["pid"]
    finally:
        code = proc.stop()
    assert code == 0
    assert not os.path.exists(f"/proc/{child}")  # reaped by the wrapper, which stopped it
    assert (tmp_path / "data" / "member").is_dir()
