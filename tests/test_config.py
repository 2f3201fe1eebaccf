from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve import config
from pdserve.config import ConfigError


@dataclass
class DemoConfig:
    host: str = config.help_field("127.0.0.1", "address to bind")
    port: int = config.help_field(0, "port, 0 = any free port")
    ratio: float = config.help_field(0.5, "a fraction")
    verbose: bool = config.help_field(False, "chatty logs")
    peers: list[str] = config.help_field([], "comma-separated peers")

    def validate(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ConfigError(f"ratio must be in [0, 1], got {self.ratio}")


def test_precedence_defaults_yaml_env_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("demo:\n  port: 1000\n  ratio: 0.25\n  peers: [a, b]\nother:\n  x: 1\n")
    env = {"PDSERVE_DEMO_PORT": "2000", "PDSERVE_DEMO_VERBOSE": "yes"}
    cfg = config.load(DemoConfig, "demo", yaml_path=path, env=env, overrides={"ratio": "0.75"})
    assert cfg == DemoConfig(port=2000, ratio=0.75, verbose=True, peers=["a", "b"])
    assert config.load(DemoConfig, "demo", env={}) == DemoConfig()


def test_flags_round_trip_through_argparse(tmp_path):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, DemoConfig)
    args = parser.parse_args(["--port", "7", "--verbose", "--peers", "x, y"])
    cfg = config.from_args(DemoConfig, "demo", args)
    assert cfg.port == 7 and cfg.verbose is True and cfg.peers == ["x", "y"]
    assert "port, 0 = any free port (default: 0)" in parser.format_help()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("demo:\n  prot: 1\n", "unknown field\\(s\\) prot"),
        ("demo:\n  port: abc\n", "'port'"),
        ("demo:\n  port: 1.5\n", "expected an integer"),
        ("demo:\n  verbose: maybe\n", "expected a boolean"),
        ("demo:\n  ratio: 3\n", "ratio must be in"),
        ("demo: [1, 2]\n", "must be a mapping"),
        ("- a\n", "mapping of sections"),
        ("demo: {port: [\n", "not valid YAML"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        config.load(DemoConfig, "demo", yaml_path=path, env={})


def test_missing_file_and_unknown_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(DemoConfig, "demo", yaml_path=tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="unknown config field"):
        config.load(DemoConfig, "demo", env={}, overrides={"nope": 1})
