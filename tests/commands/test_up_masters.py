"""`pdserve up --kvstore-masters N` (``up_etcd``): several KV store masters electing through an
etcd (up's own, or meta's), every client given the list; checked without starting anything,
then end to end with the leader killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from up_harness import complete, pids_with, services_of

from pdserve import config
from pdserve.commands.cli import build_parser
from pdserve.commands.up import UpConfig, banner


def test_kvstore_masters_is_checked(tmp_path: Path):
    args = build_parser().parse_args(
        ["up", "--kvstore-masters", "3", "--etcd-port", "40000", "--run-dir", str(tmp_path)]
    )
    cfg = config.from_args(UpConfig, "up", args)
    assert (cfg.kvstore_masters, cfg.etcd_port) == (3, 40000)
    assert cfg.master_addresses() == [f"127.0.0.1:{p}" for p in (50051, 50052, 50053)]
    assert "KV store masters  127.0.0.1:50051,127.0.0.1:50052,127.0.0.1:50053" in banner(cfg)
    assert "elected through etcd 127.0.0.1:40000" in banner(cfg)
    assert UpConfig().kvstore_masters == 1 and "KV store master  127.0.0.1:50051" in banner(
        UpConfig(run_dir=str(tmp_path))
    )

    def load(**env: object) -> UpConfig:
        return config.load(
            UpConfig, "up", env={f"PDSERVE_UP_{k.upper()}": str(v) for k, v in env.items()}
        )

    for n in (0, 6):
        with pytest.raises(config.ConfigError, match="kvstore_masters must be 1 to 5"):
            load(kvstore_masters=n)
    with pytest.raises(config.ConfigError, match="needs store_backend pdserve"):
        load(kvstore_masters=2, store_backend="mooncake")
    # master i listens on master_port + i: none of up's other ports may be among them
    with pytest.raises(config.ConfigError, match=r"router_port 50053 is among .* 50051..50053"):
        load(kvstore_masters=3, router_port=50053)
    load(kvstore_masters=2, router_port=50053)
    with pytest.raises(config.ConfigError, match="meta_port 50052 is among"):
        load(kvstore_masters=2, meta_port=50052)
    with pytest.raises(config.ConfigError, match="etcd_port 50052 is among"):
        load(kvstore_masters=2, etcd_port=50052)
    with pytest.raises(config.ConfigError, match=r"etcd_port \+ 1 \(its peer port\) 50051"):
        load(kvstore_masters=2, etcd_port=50050, meta_port=40000)
    with pytest.raises(config.ConfigError, match="http_port 50091 is up's etcd's port"):
        load(kvstore_masters=2, http_port=50091)
    with pytest.raises(config.ConfigError, match="master_port"):
        load(kvstore_masters=2, master_port=65535)
    with pytest.raises(config.ConfigError, match="etcd_port must be"):
        load(kvstore_masters=2, etcd_port=65535)
    # up's own etcd only without meta's: then its port is not checked; one master checks nothing
    load(kvstore_masters=2, meta_backend="etcd", etcd_port=50052)
    load(etcd_port=50052, router_port=50051)


class _FakeProc:
    """What up's Cluster needs of a started service, started by nobody."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.pid = name, args, 4242
        self.log_path = log_dir / f"{name}.log"
        self.info: dict[str, object] = {}

    def alive(self) -> bool:
        return True


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _started_by_up(monkeypatch, tmp_path: Path, **fields: object) -> tuple[dict, list, object]:
    """What `pdserve up` would start with these UpConfig fields, nothing started: {service name:
    its arguments} in start order, the addresses whose health up checked, and the Cluster."""
    from pdserve import grpcutil, procs
    from pdserve.commands import etcd as etcd_command
    from pdserve.commands.up_cluster import Cluster

    cfg = UpConfig(run_dir=str(tmp_path / "run"), engine="torch", decode_workers=1, **fields)
    cfg.validate()
    cfg.resolve(gpus=[])
    started: dict[str, list[str]] = {}
    checked: list[str] = []

    def spawn(name: str, args: list[str], log_dir: Path, **_kw) -> _FakeProc:
        started[name] = args
        return _FakeProc(name, args, log_dir)

    def ready(proc: _FakeProc, _timeout: float) -> _FakeProc:
        if "--port" in proc.args and proc.args[0] != "etcd":
            proc.info = {"grpc": f"127.0.0.1:{_flag(proc.args, '--port')}"}
            if "--ha-etcd" in proc.args:  # an HA master: READY as a standby
                proc.info["standby"] = True
        return proc

    async def health(address: str, *_a, **_kw) -> bool:
        checked.append(address)
        return True

    monkeypatch.setattr(procs, "spawn_service", spawn)
    monkeypatch.setattr(procs, "wait_ready", ready)
    monkeypatch.setattr(grpcutil, "check_health", health)
    monkeypatch.setattr(etcd_command, "binary", lambda: "/usr/bin/etcd")
    cluster = Cluster(cfg, str(tmp_path / "cluster.yaml"))
    monkeypatch.setattr(cluster.creds, "secure", lambda _identities: None)
    monkeypatch.setattr(cluster, "_wait_for_workers", lambda _router: None)
    cluster.start()
    return started, checked, cluster


def test_up_starts_ha_masters_on_its_own_etcd_and_gives_every_client_the_list(
    monkeypatch, tmp_path: Path
):
    started, checked, cluster = _started_by_up(monkeypatch, tmp_path, kvstore_masters=2)
    run_dir = tmp_path / "run"
    assert list(started) == [
        "etcd", "meta", "kvstore-master-0", "kvstore-master-1", "kvstore-node-0", "decode-0",
        "router",
    ]  # fmt: skip
    # up's etcd: loopback, its data in the run dir, ports from etcd_port, TLS with a CA of
    # its own whose only client certificate is the masters'; no --config
    etcd_certs = (run_dir / "certs" / "etcd").resolve()
    assert started["etcd"] == [
        "etcd", "--data-dir", str((run_dir / "etcd").resolve()), "--host", "127.0.0.1",
        "--port", "50090", "--peer-port", "50091", "--tls-ca", str(etcd_certs / "ca.crt"),
        "--tls-cert", str(etcd_certs / "etcd.crt"), "--tls-key", str(etcd_certs / "etcd.key"),
    ]  # fmt: skip
    assert "--config" in started["meta"]
    # master i on master_port + i, electing through that etcd, no state dir, one identity
    for i in (0, 1):
        args = started[f"kvstore-master-{i}"]
        assert _flag(args, "--port") == str(50051 + i)
        assert _flag(args, "--ha-etcd") == "127.0.0.1:50090"
        assert _flag(args, "--state-dir") == ""
        assert _flag(args, "--tls-cert").endswith("/certs/kvstore-master.crt")
        assert _flag(args, "--ha-etcd-ca") == str(etcd_certs / "ca.crt")
        assert _flag(args, "--ha-etcd-cert") == str(etcd_certs / "kvstore-master.crt")
        assert _flag(args, "--config") == str(tmp_path / "cluster.yaml")
    # the first was waited for until it led (its health); the standby's was not checked
    assert "127.0.0.1:50051" in checked and "127.0.0.1:50052" not in checked
    both = "127.0.0.1:50051,127.0.0.1:50052"
    assert _flag(started["kvstore-node-0"], "--master-address") == both
    assert _flag(started["decode-0"], "--store-master") == both
    assert _flag(started["router"], "--store-master") == both
    # services.json says where each master listens (`pdserve status` shows which leads)
    cluster.write_status()
    data = json.loads((run_dir / "services.json").read_text())
    assert data["kvstore_masters"] == {
        "kvstore-master-0": "127.0.0.1:50051",
        "kvstore-master-1": "127.0.0.1:50052",
    }
    assert [r["name"] for r in data["services"]][:4] == ["etcd", "meta", *data["kvstore_masters"]]
    # an external engine's connector gets the list too
    from pdserve.commands import up_external

    ext = UpConfig(kvstore_masters=2, external_engine=["http://127.0.0.1:8100"])
    (engine,) = up_external.engines(ext)
    extra = up_external.kv_transfer_config(ext, engine)["kv_connector_extra_config"]
    assert extra["master_address"] == both


def test_up_ha_masters_use_metas_etcd_and_one_master_is_unchanged(monkeypatch, tmp_path: Path):
    started, _, _ = _started_by_up(
        monkeypatch, tmp_path, kvstore_masters=3, meta_backend="etcd",
        etcd_endpoints=["10.0.0.9:2379", "10.0.0.10:2379"],
    )  # fmt: skip
    assert "etcd" not in started  # meta's etcd: up runs none
    assert _flag(started["meta"], "--etcd-endpoints") == "10.0.0.9:2379,10.0.0.10:2379"
    for i in range(3):
        assert _flag(started[f"kvstore-master-{i}"], "--ha-etcd") == "10.0.0.9:2379,10.0.0.10:2379"
    started, checked, cluster = _started_by_up(monkeypatch, tmp_path / "one")
    assert list(started)[:3] == ["meta", "kvstore-master", "kvstore-node-0"]
    master = started["kvstore-master"]
    assert "--ha-etcd" not in master and _flag(master, "--port") == "50051"
    assert _flag(master, "--state-dir") == str(tmp_path / "one" / "run" / "kvstore-master")
    assert _flag(started["router"], "--store-master") == "127.0.0.1:50051"
    assert "127.0.0.1:50051" in checked
    cluster.write_status()
    assert "kvstore_masters" not in json.loads((tmp_path / "one/run/services.json").read_text())


def test_up_refuses_ha_masters_without_an_etcd_binary_before_starting_anything(
    monkeypatch, tmp_path: Path
):
    from pdserve import procs
    from pdserve.commands import etcd as etcd_command
    from pdserve.commands.up_cluster import Cluster

    monkeypatch.setattr(etcd_command, "binary", lambda: None)
    monkeypatch.setattr(procs, "spawn_service", lambda *a, **k: pytest.fail("started something"))
    cfg = UpConfig(run_dir=str(tmp_path), engine="torch", decode_workers=1, kvstore_masters=2)
    cfg.resolve(gpus=[])
    with pytest.raises(RuntimeError, match="apt-get install etcd-server"):
        Cluster(cfg, None).start()
    assert not (tmp_path / "certs").exists()


def _status_json(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "status", "--run-dir", str(run_dir),
         "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.startswith("{"), out.stdout + out.stderr
    return json.loads(out.stdout)


def _leading(run_dir: Path) -> list[str]:
    """The service names of the KV masters that lead, as `pdserve status` sees them."""
    names = {
        a: n
        for n, a in json.loads((run_dir / "services.json").read_text())["kvstore_masters"].items()
    }
    return [names[m["address"]] for m in _status_json(run_dir)["masters"] if m["leading"]]


def _leader(run_dir: Path) -> str:
    """The service name of the one KV master that leads."""
    leading = _leading(run_dir)
    assert len(leading) == 1, leading
    return leading[0]


@pytest.mark.slow
def test_up_with_two_kv_masters_serves_on_after_the_leader_is_killed(tmp_path: Path):
    """`up --kvstore-masters 2`: an etcd of its own, two masters (the first leads, the second
    stands by), every client naming both. SIGKILL of the leading master: completions still
    work (the standby takes over), up restarts the killed one and it comes back as a standby;
    `pdserve status` shows which one leads throughout. Ctrl-C stops etcd too."""
    from up_harness import quiet_pair, quiet_ports, read_banner, stop_up

    from pdserve.commands.etcd import binary, healthy

    if binary() is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    meta, meta_http, router, http = quiet_ports(4)
    master = quiet_pair(avoid=(meta, meta_http, router, http))
    etcd = quiet_pair(avoid=(meta, meta_http, router, http, master, master + 1))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "pdserve.commands.cli", "up", "--engine", "torch", "--model", "tiny",
        "--chunk-size", "16", "--segment-size", "64MiB", "--decode-workers", "1",
        "--kvstore-masters", "2", "--etcd-port", str(etcd), "--meta-port", str(meta),
        "--meta-http-port", str(meta_http), "--master-port", str(master), "--router-port",
        str(router), "--http-port", str(http), "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner_text = read_banner(proc)
    try:
        both = f"127.0.0.1:{master},127.0.0.1:{master + 1}"
        assert f"KV store masters  {both}" in banner_text
        while not (run_dir / "services.json").exists():  # written right after the banner
            assert proc.poll() is None
            time.sleep(0.1)
        services = services_of(run_dir)
        assert {"etcd", "kvstore-master-0", "kvstore-master-1"} <= set(services)
        assert "kvstore-master" not in services
        assert _leader(run_dir) == "kvstore-master-0"
        key = (run_dir / "api_key").read_text().strip()
        prompt = "shared prefix for the masters " * 4
        want = complete(http, prompt, key)["choices"][0]["text"]

        victim = services["kvstore-master-0"]
        os.kill(victim["pid"], signal.SIGKILL)
        assert complete(http, prompt, key)["choices"][0]["text"] == want
        deadline = time.monotonic() + 120
        while True:
            now = services_of(run_dir)["kvstore-master-0"]
            if now["restarts"] == 1 and now["state"] == "running":
                break
            assert time.monotonic() < deadline, f"the killed master was not restarted: {now}"
            time.sleep(0.5)
        assert now["last_exit"] == -signal.SIGKILL and now["pid"] != victim["pid"]
        # a master leads again once the killed one's lease has ended: the standby, unless up
        # restarted the killed one first and it won that election (an election: either may)
        deadline = time.monotonic() + 60
        while not (leading := _leading(run_dir)):
            assert time.monotonic() < deadline, "no KV master leads a minute after the kill"
            time.sleep(0.5)
        assert len(leading) == 1, leading
        # the restarted master (its log is this run's) came back as a standby: its first
        # READY says so; it may lead now, having won the election once the killed one's lease
        # ended (either may: seen in the suite), and then says so in a second READY
        log = (run_dir / "logs" / "kvstore-master-0.log").read_text()
        ready = [line for line in log.splitlines() if line.startswith("PDSERVE_READY")]
        assert ready and '"standby": true' in ready[0], log[-2000:]
        assert len(ready) in (1, 2), ready
        assert complete(http, prompt + "again", key)["choices"][0]["finish_reason"] == "length"
        etcd_client = f"--listen-client-urls=https://127.0.0.1:{etcd}"
        assert len(pids_with(etcd_client)) == 1  # the etcd `pdserve etcd` runs
        # it takes the masters' certificate of its own CA, and nothing else: not plaintext,
        # not another service's certificate of the cluster's CA
        own, certs = run_dir / "certs" / "etcd", run_dir / "certs"
        address = f"127.0.0.1:{etcd}"
        ca = str(own / "ca.crt")
        assert healthy(
            address, (ca, str(own / "kvstore-master.crt"), str(own / "kvstore-master.key"))
        )
        assert not healthy(address)
        node = certs / f"node-0-{master}"
        assert not healthy(address, (ca, f"{node}.crt", f"{node}.key"))
        assert not healthy(address, (ca, str(certs / "admin.crt"), str(certs / "admin.key")))
    finally:
        stop_up(proc, timeout=90)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "without TLS or authentication" not in err
    assert pids_with(etcd_client) == []
    assert not (run_dir / "services.json").exists()
