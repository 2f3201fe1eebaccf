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
from up_harness import (
    complete,
    dashboard_series,
    pids_with,
    scrape_discovered,
    services_of,
    shm_mapped,
    start_up,
    zombie,
)

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
        assert not os.path.exists(f"/proc/{pid}") or zombie(pid), f"pid {pid} still runs"
    assert not [f for f in os.listdir("/dev/shm") if "node-0-seg" in f and str(run_dir) in f]
    assert not any(Path("/dev/shm").glob(f"pdserve-kv-node-0-{master}-seg*"))


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
            before = services_of(run_dir)[victim]
            os.kill(before["pid"], signal.SIGKILL)
            # Served while it is down and while it comes back, token for token.
            assert [complete(http, p, key)["choices"][0]["text"] for p in prompts] == want
            deadline = time.monotonic() + 120
            while True:
                now = services_of(run_dir)[victim]
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


def _mooncake_pids(port: int) -> list[int]:
    """Live processes of the Mooncake Store on rpc port ``port`` (master, storage)."""
    return pids_with("mooncake", str(port))


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
        services = services_of(run_dir)
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
