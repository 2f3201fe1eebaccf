"""`pdserve up` end to end: the printed examples return text; SIGINT leaves nothing behind;
mutual TLS between the services and an API key on the router by default."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from up_harness import complete, dashboard_series, scrape_discovered, shm_mapped, start_up

from pdserve import config
from pdserve.commands.cli import build_parser
from pdserve.commands.up import UpConfig, banner
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()}


def _up(tmp_path: Path) -> tuple[subprocess.Popen, str, dict[str, int], Path]:
    """A `pdserve up` (torch engine, tiny model) on free ports, once its banner is out."""
    return start_up(
        tmp_path, "--engine", "torch", "--model", "tiny", "--chunk-size", "16",
        "--segment-size", "64MiB",
    )  # fmt: skip


@pytest.mark.slow
def test_up_serves_the_printed_examples_is_secure_by_default_and_stops_cleanly(tmp_path: Path):
    """The banner's examples work as printed. Secure by default: the router wants the key in
    <run_dir>/api_key (401 without it), the internal services take mutual TLS only (a
    plaintext client of the master is turned away), and `pdserve status --run-dir` dials them
    with up's admin certificate. Ctrl-C stops every process and leaves no shared memory."""
    proc, banner, ports, run_dir = _up(tmp_path)
    meta, master = ports["meta"], ports["master"]
    try:
        children = _children(proc.pid)
        # meta, master, node, router and the default topology: one worker per core (at most
        # 8), each prefilling and decoding
        assert len(children) == 4 + min(os.cpu_count() or 1, 8)
        curl = re.search(r"(curl -s .*?\n.*?-d '.*?')", banner, re.S).group(1)
        out = subprocess.run(
            ["bash", "-c", curl.replace("\\\n", " ")], capture_output=True, text=True, timeout=120
        ).stdout
        assert '"text_completion"' in out and '"finish_reason": "length"' in out, out
        # the generate example reads the key from the run dir into $PDSERVE_API_KEY
        gen = re.search(r"(PDSERVE_API_KEY=.*pdserve generate .*)", banner).group(1)
        gen = gen.replace(
            ".venv/bin/pdserve", f"{shlex.quote(sys.executable)} -m pdserve.commands.cli"
        )
        res = subprocess.run(["bash", "-c", gen], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and res.stdout.strip(), res.stderr
        assert "[length]" in res.stderr
        # the banner's status command (it dials the mutual-TLS services as up's admin)
        cmd = re.search(r"status: (pdserve status .*)", banner).group(1)
        assert f"127.0.0.1:{meta}" in cmd
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", *shlex.split(cmd)[1:]],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        for role in ("decode", "kvstore-master", "kvstore-node"):
            assert role in status.stdout

        # the CA's key never touched the disk: the services cannot mint identities
        assert (run_dir / "certs" / "ca.crt").exists()
        assert not (run_dir / "certs" / "ca.key").exists()
        key_file = run_dir / "api_key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert len(key) >= 32
        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(ports["http"], "Once upon a time", "")
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as wrong:
            complete(ports["http"], "Once upon a time", key + "x")
        assert wrong.value.code == 401
        done = complete(ports["http"], "Once upon a time", key)
        assert done["choices"][0]["finish_reason"] == "length"

        with (
            grpc.insecure_channel(f"127.0.0.1:{ports['master']}") as ch,
            pytest.raises(grpc.RpcError) as plain,
        ):
            kvstore_pb2_grpc.KVMasterServiceStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        # the run dir alone: meta's address (not the default port here) comes from it too
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "status", "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"meta 127.0.0.1:{ports['meta']}:" in status.stdout
        assert "kvstore-master" in status.stdout and " NO " not in status.stdout
        # without the run dir (and without PDSERVE_TLS_*) it cannot reach meta, and says why
        bare = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "status", "--meta",
             f"127.0.0.1:{ports['meta']}", "--run-dir", str(tmp_path / "elsewhere")],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_TLS_")},
        )  # fmt: skip
        assert bare.returncode == 1 and "PDSERVE_TLS_CA" in bare.stderr, bare.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"pid {pid} still runs"
    assert not [f for f in os.listdir("/dev/shm") if "node-0-seg" in f and str(run_dir) in f]
    assert not any(Path("/dev/shm").glob(f"pdserve-kv-node-0-{master}-seg*"))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _services(run_dir: Path) -> dict[str, dict]:
    data = json.loads((run_dir / "services.json").read_text())
    return {r["name"]: r for r in data["services"]}


@pytest.mark.slow
def test_up_restarts_a_killed_service_while_the_rest_keeps_serving(tmp_path: Path):
    """SIGKILL of the storage node, the store master, meta and a worker, one at a time:
    every request meanwhile completes, `up` restarts each (shown in services.json and
    `pdserve status`), and the store keeps its objects across the node's and the master's
    restart."""
    proc, _banner, ports, run_dir = _up(tmp_path)
    http = ports["http"]
    key = (run_dir / "api_key").read_text().strip()
    prompts = [f"shared prefix number {i % 2} " * 6 for i in range(4)]
    try:
        want = [complete(http, p, key)["choices"][0]["text"] for p in prompts]
        for victim in ("kvstore-node-0", "kvstore-master", "meta", "decode-0"):
            before = _services(run_dir)[victim]
            os.kill(before["pid"], signal.SIGKILL)
            # Served while it is down and while it comes back, token for token.
            assert [complete(http, p, key)["choices"][0]["text"] for p in prompts] == want
            deadline = time.monotonic() + 120
            while True:
                now = _services(run_dir)[victim]
                if now["restarts"] == 1 and now["state"] == "running":
                    break
                assert time.monotonic() < deadline, f"{victim} was not restarted: {now}"
                time.sleep(0.5)
            assert now["last_exit"] == -signal.SIGKILL and now["pid"] != before["pid"]
            assert [complete(http, p, key)["choices"][0]["text"] for p in prompts] == want
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "status", "--meta", f"127.0.0.1:{ports['meta']}",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "kvstore-master" in status.stdout and "-9" in status.stdout, status.stdout
        # The prompts' chunks survived both store restarts: they are still read from it.
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read()
        hits = re.search(rb'pdserve_router_prompt_tokens_total\{source="store"\} (\S+)', metrics)
        before_last = float(hits.group(1))
        complete(http, prompts[0], key)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read()
        hits = re.search(rb'pdserve_router_prompt_tokens_total\{source="store"\} (\S+)', metrics)
        assert float(hits.group(1)) > before_last
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert not (run_dir / "services.json").exists()


@pytest.mark.slow
def test_up_serves_the_default_models_hugging_face_id_under_that_name(tmp_path: Path):
    """`--model HuggingFaceTB/SmolLM2-135M-Instruct`, as `vllm serve` takes it: the shipped
    model serves under that id (the OpenAI model list, a chat completion naming it)."""
    hf_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    proc, _banner, ports, run_dir = start_up(
        tmp_path, "--engine", "torch", "--model", hf_id, "--decode-workers", "1",
        "--segment-size", "64MiB",
    )  # fmt: skip
    try:
        key = (run_dir / "api_key").read_text().strip()
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        base = f"http://127.0.0.1:{ports['http']}"
        req = urllib.request.Request(f"{base}/v1/models", headers=auth)
        models = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert [m["id"] for m in models["data"]] == [hf_id]
        body = {"model": hf_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), auth)
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert out["model"] == hf_id and out["usage"]["completion_tokens"] >= 1, out
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_tls_and_auth_turn_off_with_flags(tmp_path: Path):
    args = build_parser().parse_args(["up", "--no-tls", "--no-auth", "--run-dir", str(tmp_path)])
    cfg = config.from_args(UpConfig, "up", args)
    assert (cfg.tls, cfg.auth) == (False, False)
    text = banner(cfg)
    assert "Authorization" not in text and "PDSERVE_TLS" not in text
    on = banner(UpConfig(run_dir=str(tmp_path)))
    assert f'-H "Authorization: Bearer $(cat {tmp_path}/api_key)"' in on
    assert f"PDSERVE_TLS_CERT={tmp_path}/certs/admin.crt" in on
    with pytest.raises(config.ConfigError, match="auth is off"):
        config.load(UpConfig, "up", env={"PDSERVE_UP_API_KEY": "k", "PDSERVE_UP_AUTH": "false"})


def test_kv_compression_is_one_setting_for_the_cluster(tmp_path: Path):
    args = build_parser().parse_args(["up", "--kv-compression", "fp8", "--run-dir", str(tmp_path)])
    cfg = config.from_args(UpConfig, "up", args)
    assert cfg.kv_compression == "fp8"
    cfg.validate()
    with pytest.raises(config.ConfigError, match="kv_compression"):
        config.load(UpConfig, "up", env={"PDSERVE_UP_KV_COMPRESSION": "int4"}).validate()


def test_store_backend_mooncake_is_checked(tmp_path: Path):
    args = build_parser().parse_args(
        ["up", "--store-backend", "mooncake", "--run-dir", str(tmp_path)]
    )
    cfg = config.from_args(UpConfig, "up", args)
    assert (cfg.store_backend, cfg.mooncake_metadata()) == ("mooncake", "P2PHANDSHAKE")
    assert "Mooncake Store (mooncake_master)  127.0.0.1:50051" in banner(cfg)
    env = {"PDSERVE_UP_STORE_BACKEND": "mooncake"}
    with pytest.raises(config.ConfigError, match="store_backend must be"):
        config.load(UpConfig, "up", env={"PDSERVE_UP_STORE_BACKEND": "redis"})
    with pytest.raises(config.ConfigError, match="host must be loopback"):
        config.load(UpConfig, "up", env={**env, "PDSERVE_UP_HOST": "10.0.0.5"})
    with pytest.raises(config.ConfigError, match="needs tls off"):
        config.load(UpConfig, "up", env={**env, "PDSERVE_UP_STORE_METADATA_SERVER": "meta"})
    meta = config.load(
        UpConfig,
        "up",
        env={**env, "PDSERVE_UP_STORE_METADATA_SERVER": "meta", "PDSERVE_UP_TLS": "false"},
    )
    assert meta.mooncake_metadata() == "http://127.0.0.1:50080/metadata"
    with pytest.raises(config.ConfigError, match="applies to store_backend mooncake"):
        config.load(UpConfig, "up", env={"PDSERVE_UP_STORE_METADATA_SERVER": "meta"})
    # the `up:` section of `pdserve up --config` takes it too
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text("up:\n  store_backend: mooncake\n  storage_nodes: 2\n")
    from_file = config.load(UpConfig, "up", yaml_path=yaml_path)
    assert (from_file.store_backend, from_file.storage_nodes) == ("mooncake", 2)


def _pids(*words: str) -> list[int]:
    """Live processes whose command line holds every one of ``words``."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if all(w in cmd for w in words) and not _zombie(int(d.name)):
            out.append(int(d.name))
    return out


def _mooncake_pids(port: int) -> list[int]:
    """Live processes of the Mooncake Store on rpc port ``port`` (master, storage)."""
    return _pids("mooncake", str(port))


@pytest.mark.slow
@pytest.mark.mooncake
def test_up_on_a_mooncake_store_is_token_exact_and_stops_cleanly(
    tmp_path: Path, tiny_model_dir, hf_greedy
):
    """`up --store-backend mooncake`: mooncake_master and a storage process instead of
    pdserve's store; a prompt of several chunks answers token-exact twice, the second time
    from chunks cached in Mooncake (cached tokens and the router's store metric); the log says
    Mooncake has no TLS; stopping `up` leaves no Mooncake process and no new shm segment."""
    from pdserve.store.mooncake_backend import available

    if not available():
        pytest.skip("mooncake-transfer-engine is not installed (mooncake.store does not import)")
    from transformers import AutoTokenizer

    from pdserve import grpcutil
    from pdserve.auth import bearer
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    shm_before = set(os.listdir("/dev/shm"))  # other tests may add files meanwhile
    from up_harness import quiet_ports

    meta, meta_http, master, router, http = quiet_ports(5)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "pdserve.commands.cli", "up", "--engine", "torch", "--model", "tiny",
        "--chunk-size", "16", "--store-backend", "mooncake", "--decode-workers", "1",
        "--prefill-workers", "1", "--meta-port", str(meta), "--meta-http-port", str(meta_http),
        "--master-port", str(master), "--router-port", str(router), "--http-port", str(http),
        "--segment-size", "64MiB", "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ""
    deadline = time.monotonic() + 300
    try:
        while "Ctrl-C stops everything" not in out:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"pdserve up did not come up: {out}")
            out += proc.stdout.readline()
        assert f"Mooncake Store (mooncake_master)  127.0.0.1:{master}" in out
        while not (run_dir / "services.json").exists():  # written right after the banner
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        services = _services(run_dir)
        assert {"mooncake-master", "mooncake-storage-0"} <= set(services)
        assert not {"kvstore-master", "kvstore-node-0"} & set(services)
        assert len(_mooncake_pids(master)) >= 2  # the wrapper's mooncake_master, the storage
        shm_used = shm_mapped(_mooncake_pids(master))

        key = (run_dir / "api_key").read_text().strip()
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        prompt = tok.encode("a lighthouse keeper counts the ships that pass the rocks " * 4)
        assert len(prompt) > 3 * 16
        want = hf_greedy(prompt, 12)
        greedy = common_pb2.SamplingParams(max_tokens=12, temperature=0.0)
        with grpcutil.sync_channel(f"127.0.0.1:{router}", public=True) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)

            def ask(rid: str) -> list:
                req = router_pb2.GenerateRequest(
                    model="tiny", prompt_token_ids=prompt, sampling=greedy, request_id=rid
                )
                return list(stub.GenerateStream(req, timeout=120, metadata=bearer(key)))

            first = ask("mc-first")
            assert [t for m in first for t in m.token_ids] == want
            assert first[0].cached_tokens == 0
            second = ask("mc-second")
            assert [t for m in second for t in m.token_ids] == want
            assert second[0].cached_tokens >= 3 * 16
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read()
        hits = re.search(rb'pdserve_router_prompt_tokens_total\{source="store"\} (\S+)', metrics)
        assert float(hits.group(1)) >= 3 * 16
        # the prefill role's dashboard series (the default topology has no prefill worker),
        # from the endpoints meta's service discovery lists
        groups, scraped = scrape_discovered(out, run_dir)
        assert "prefill" in {g["labels"]["pdserve_role"] for g in groups}, groups
        prefill = {n for n in dashboard_series() if n.startswith("pdserve_prefill_")}
        assert prefill and sorted(prefill - scraped) == []
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert "Mooncake's own links" in err and "no TLS" in err, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert _mooncake_pids(master) == []
    assert not (run_dir / "services.json").exists()
    # what the Mooncake processes had mapped from /dev/shm (if anything) is gone with them
    assert not [f for f in shm_used if os.path.exists(f) and os.path.basename(f) not in shm_before]


# --- several KV store masters (up_etcd) ------------------------------------------------------


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


def _leader(run_dir: Path) -> str:
    """The service name of the KV master that leads, as `pdserve status` sees it."""
    names = {
        a: n
        for n, a in json.loads((run_dir / "services.json").read_text())["kvstore_masters"].items()
    }
    leading = [names[m["address"]] for m in _status_json(run_dir)["masters"] if m["leading"]]
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
        services = _services(run_dir)
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
            now = _services(run_dir)["kvstore-master-0"]
            if now["restarts"] == 1 and now["state"] == "running":
                break
            assert time.monotonic() < deadline, f"the killed master was not restarted: {now}"
            time.sleep(0.5)
        assert now["last_exit"] == -signal.SIGKILL and now["pid"] != victim["pid"]
        assert _leader(run_dir) == "kvstore-master-1"  # the restarted one stands by
        log = (run_dir / "logs" / "kvstore-master-0.log").read_text()
        assert '"standby": true' in log.rsplit("PDSERVE_READY", 1)[-1], log[-2000:]
        assert complete(http, prompt + "again", key)["choices"][0]["finish_reason"] == "length"
        etcd_client = f"--listen-client-urls=https://127.0.0.1:{etcd}"
        assert len(_pids(etcd_client)) == 1  # the etcd `pdserve etcd` runs
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
    assert _pids(etcd_client) == []
    assert not (run_dir / "services.json").exists()
