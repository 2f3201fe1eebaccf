from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.commands.cli import build_parser

EXPECTED = {"up", "status", "router", "prefill", "decode", "kvstore", "meta", "model", "bench"}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from _commands(sub, (*path, name))


@pytest.mark.slow
def test_top_level_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in EXPECTED:
        assert f"\n    {name}" in out, f"{name} missing from pdserve --help:\n{out}"


@pytest.mark.parametrize("path", sorted(_commands(build_parser())), ids=" ".join)
def test_every_command_has_a_useful_help(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdserve {' '.join(path)}")
    # a description or per-option help beyond the bare usage line
    assert len(out.splitlines()) > 4


@pytest.mark.slow
def test_no_command_prints_help_and_fails():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage: pdserve" in proc.stdout
