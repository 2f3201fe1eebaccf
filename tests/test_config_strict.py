"""Every config file is strict: an unknown section, or an unknown field in any section, is an
error naming the key and the file (with the closest known name), for each service's config and
for ``pdserve up --config``; the shipped and documented files still load."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve import config
from pdserve.commands import cli
from pdserve.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]

#: The command that reads each section (``pdserve <args> --config FILE``).
COMMANDS = {
    "up": ["up"],
    "meta": ["meta"],
    "kvstore_master": ["kvstore", "master"],
    "kvstore_node": ["kvstore", "node"],
    "prefill": ["prefill"],
    "decode": ["decode"],
    "router": ["router"],
}


def test_every_section_has_a_command():
    assert set(COMMANDS) == set(config.SECTIONS)


def write(tmp_path: Path, data: dict, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


def a_typo(section: str) -> tuple[str, str]:
    """(a misspelt field of ``section``, the field)."""
    fields = [f.name for f in dataclasses.fields(config.section_class(section))]
    field = max(fields, key=len)  # long names: one dropped letter stays the closest
    return field[:-1], field


@pytest.mark.parametrize("section", list(config.SECTIONS))
def test_unknown_field_names_field_file_and_suggestion(tmp_path, section):
    typo, field = a_typo(section)
    path = write(tmp_path, {section: {typo: 1}})
    with pytest.raises(ConfigError) as exc:
        config.load(config.section_class(section), section, yaml_path=path, env={})
    msg = str(exc.value)
    assert str(path) in msg and f"unknown field(s) {typo}" in msg
    assert f"did you mean {field!r}?" in msg


@pytest.mark.parametrize("section", list(config.SECTIONS))
def test_unknown_section_is_an_error_for_every_service(tmp_path, section):
    path = write(tmp_path, {"prefil": {"engine": "torch"}, section: {}})
    with pytest.raises(ConfigError, match=r"unknown section or key 'prefil' \(did you mean "):
        config.load(config.section_class(section), section, yaml_path=path, env={})


@pytest.mark.parametrize("section", list(config.SECTIONS))
def test_a_typo_in_another_section_is_caught_too(tmp_path, section):
    other = "router" if section != "router" else "decode"
    typo, _ = a_typo(other)
    path = write(tmp_path, {other: {typo: 1}}, "c.json")  # JSON works like YAML
    with pytest.raises(ConfigError, match=rf"section '{other}': unknown field\(s\) {typo}"):
        config.load(config.section_class(section), section, yaml_path=path, env={})


def test_a_bad_value_in_another_section_is_caught(tmp_path):
    path = write(tmp_path, {"decode": {"chunk_size": "many"}})
    with pytest.raises(ConfigError, match=r"'decode\.chunk_size'"):
        config.load(config.section_class("prefill"), "prefill", yaml_path=path, env={})


@pytest.mark.parametrize("section", list(config.SECTIONS))
def test_commands_refuse_the_file_with_exit_2(tmp_path, capsys, section):
    """``pdserve <command> --config FILE`` (and ``pdserve up --config``): exit 2 and the
    message, before anything starts."""
    path = write(tmp_path, {"routr": {"policy": "cache_aware"}})
    assert cli.main([*COMMANDS[section], "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown section or key 'routr' (did you mean 'router'?)" in err
    assert str(path) in err


def test_up_refuses_a_typo_in_a_service_section(tmp_path, capsys):
    path = write(tmp_path, {"up": {"storage_nodes": 1}, "kvstore_node": {"segment_size": "1GiB"}})
    assert cli.main(["up", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "section 'kvstore_node': unknown field(s) segment_size" in err
    assert "did you mean 'segment_sizes'?" in err


def test_unknown_flag_override_suggests():
    with pytest.raises(ConfigError, match="'chunk_sze' for prefill \\(did you mean 'chunk_size'"):
        config.load(config.section_class("prefill"), "prefill", env={}, overrides={"chunk_sze": 1})


def test_shipped_cluster_yaml_loads_for_every_section():
    path = ROOT / "deploy" / "cluster.yaml"
    config.check_file(path)
    cfg = config.load(config.section_class("prefill"), "prefill", yaml_path=path, env={})
    assert cfg.chunk_size == 256 and cfg.store_backend == "pdserve"


def test_readme_cluster_example_loads(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "pdserve up --config" in b]
    path = tmp_path / "cluster.yaml"
    path.write_text(block)
    data = config.check_file(path)
    assert set(data) <= set(config.SECTIONS)
    up = config.load(config.section_class("up"), "up", yaml_path=path, env={})
    assert up.prefill_workers == 2 and up.chunk_size == 32
