from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.commands.cli import COMMANDS, build_parser

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


def test_the_command_table_names_every_command_its_modules_register():
    """COMMANDS (command -> module) is what a command line imports: it must say where each
    command lives, and each module must register exactly the commands the table gives it."""
    for command, module in COMMANDS.items():
        names = set(_top_level(build_parser(command)))
        assert command in names, f"{module} does not register {command!r}"
        assert names == {c for c, m in COMMANDS.items() if m == module}, (command, names)
    assert set(_top_level(build_parser())) == set(COMMANDS)


@pytest.mark.slow
def test_a_command_imports_only_its_own_module():
    """`pdserve health` (the lab's healthchecks, every few seconds) loads neither torch nor
    another command's module (with them it took 10 s of a busy core)."""
    code = (
        "import sys; from pdserve.commands import cli\n"
        "rc = cli.main(['health', '127.0.0.1:1', '--timeout', '0.1'])\n"
        "print(sorted(m for m in ('torch', 'vllm', 'pdserve.services.router.config') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _top_level(parser: argparse.ArgumentParser) -> list[str]:
    return [name for name, *rest in (p for p in _commands(parser)) if not rest]
