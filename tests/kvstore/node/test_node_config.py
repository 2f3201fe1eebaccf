"""Storage node configuration and CLI input validation (no processes beyond the CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.config import ConfigError, load
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.sizes import parse_size
from pdserve.store.segment import shm_name


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("4096", 4096),
        ("4KiB", 4096),
        ("1GiB", 1 << 30),
        ("1.5MiB", 1572864),
        ("2mb", 2 * 1024**2),  # binary, as Mooncake reads it (pdserve.sizes)
        (7, 7),
    ],
)
def test_node_parse_size(text, want) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "0", "-1MiB", "12XB", "MiB", "1 2"])
def test_node_parse_size_rejects(text) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_node_config_validation() -> None:
    cfg = load(NodeConfig, "kvstore_node", env={}, overrides={"segment_sizes": "1MiB,2MiB"})
    assert cfg.segment_bytes() == [1 << 20, 2 << 20]
    assert cfg.node_id  # defaulted
    with pytest.raises(ConfigError, match="segment_sizes"):
        load(NodeConfig, "kvstore_node", env={}, overrides={"segment_sizes": "lots"})
    with pytest.raises(ConfigError, match="transports"):
        load(NodeConfig, "kvstore_node", env={}, overrides={"transports": "shm,carrier-pigeon"})
    with pytest.raises(ConfigError, match="master_address"):
        load(NodeConfig, "kvstore_node", env={}, overrides={"master_address": "nowhere"})


def test_node_shm_names_are_safe() -> None:
    assert shm_name("a/b c-seg0") == "pdserve-kv-a_b_c-seg0"


@pytest.mark.slow
def test_node_cli_rejects_bad_size() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.commands.cli",
            "kvstore",
            "node",
            "--segment-sizes",
            "12XB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "segment_sizes" in out.stderr and "12XB" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"disk_size": "1GiB"}, "disk_path is empty"),
        ({"disk_path": "/dev/shm/kv", "disk_size": "1GiB"}, "tmpfs .memory., not a disk"),
        ({"disk_path": "/var/tmp/kv", "disk_size": "1GiB", "transports": "shm"}, "served over tcp"),
        ({"disk_path": "/var/tmp/kv", "disk_size": "lots"}, "disk_size"),
    ],
)
def test_a_bad_disk_tier_is_refused_with_the_reason(overrides, why) -> None:
    with pytest.raises(ConfigError, match=why):
        load(NodeConfig, "kvstore_node", env={}, overrides=overrides)


def test_a_disk_tier_is_a_path_and_a_size() -> None:
    cfg = load(
        NodeConfig,
        "kvstore_node",
        env={},
        overrides={"disk_path": "/var/tmp/kv", "disk_size": "2GiB"},
    )
    assert cfg.disk_bytes() == 2 << 30
    assert load(NodeConfig, "kvstore_node", env={}, overrides={}).disk_bytes() == 0
