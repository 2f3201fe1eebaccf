"""``isolate_services`` decided without starting anything: auto isolates as root where the
services can reach their files, says why not elsewhere; on refuses; off never isolates."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import pdserve
from pdserve import config
from pdserve.commands.up import UpConfig, banner
from pdserve.commands.up_isolation import Isolation, mode


@pytest.fixture
def reachable(monkeypatch):
    """A folder other users can enter (under /tmp, 0755), with the interpreter and the pdserve
    package taken to be reachable wherever this checkout lives."""
    base = Path(tempfile.mkdtemp(prefix="pdserve-iso-"))
    base.chmod(0o755)
    monkeypatch.setattr(sys, "executable", "/bin/sh")
    monkeypatch.setattr(pdserve, "__file__", "/usr/lib/os-release")
    yield base
    shutil.rmtree(base)


def as_root(monkeypatch, root: bool) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)


def test_modes_take_yaml_booleans_and_refuse_the_rest():
    assert [mode(v) for v in ("auto", "ON", "off", True, "false", "yes")] == [
        "auto", "on", "off", "on", "off", "on"
    ]  # fmt: skip
    with pytest.raises(config.ConfigError, match=r"auto, on, off.*'maybe'"):
        mode("maybe")
    with pytest.raises(config.ConfigError, match="isolate_services must be"):
        config.load(UpConfig, "up", env={"PDSERVE_UP_ISOLATE_SERVICES": "sometimes"})
    assert config.load(UpConfig, "up", env={}).isolate_services == "auto"


def test_auto_isolates_as_root_when_every_folder_is_reachable(monkeypatch, reachable):
    as_root(monkeypatch, True)
    model = reachable / "model"
    model.mkdir()
    iso = Isolation("auto", reachable / "run")
    iso.check([model])
    assert iso.on and iso.note == ""
    assert (reachable / "run").stat().st_mode & 0o777 == 0o755
    assert iso.uid("router") != iso.uid("meta")  # a user id per identity


def test_auto_says_which_folder_blocks_isolation_and_on_refuses(monkeypatch, reachable):
    as_root(monkeypatch, True)
    locked = reachable / "locked"
    (locked / "model").mkdir(parents=True)
    locked.chmod(0o700)
    iso = Isolation("auto", reachable / "run")
    iso.check([locked / "model"])
    assert not iso.on and iso.uid("router") is None
    assert f"{locked} is not searchable by other users" in iso.note
    assert f"chmod o+x {locked}" in iso.note and "the model" in iso.note
    with pytest.raises(config.ConfigError, match=f"isolate_services: {locked} is not searchable"):
        Isolation("on", reachable / "run").check([locked / "model"])
    off = Isolation("off", reachable / "run")
    off.check([locked / "model"])
    assert (off.on, off.note) == (False, "")  # asked for: nothing to say


def test_without_root_or_with_mooncake_auto_runs_as_one_user_and_says_so(monkeypatch, reachable):
    as_root(monkeypatch, False)
    iso = Isolation("auto", reachable / "run")
    iso.check()
    assert not iso.on and "takes root" in iso.note and "read the others' keys" in iso.note
    with pytest.raises(config.ConfigError, match="takes root"):
        Isolation("on", reachable / "run").check()
    as_root(monkeypatch, True)
    moon = Isolation("auto", reachable / "run")
    moon.check(store_backend="mooncake")
    assert not moon.on and "mooncake" in moon.note
    with pytest.raises(config.ConfigError, match="mooncake"):
        config.load(
            UpConfig,
            "up",
            env={"PDSERVE_UP_STORE_BACKEND": "mooncake", "PDSERVE_UP_ISOLATE_SERVICES": "on"},
        )


def test_the_banner_says_whether_the_services_are_isolated(monkeypatch, reachable):
    cfg = UpConfig(run_dir=str(reachable / "run"))
    as_root(monkeypatch, True)
    iso = Isolation("auto", cfg.run_dir)
    iso.check()
    assert "services run as Unix users of their own" in banner(cfg, isolation=iso)
    as_root(monkeypatch, False)
    iso = Isolation("auto", cfg.run_dir)
    iso.check()
    assert f"NOT isolated: {iso.note}" in banner(cfg, isolation=iso)
    assert "isolated" not in banner(cfg, isolation=Isolation("off", cfg.run_dir))
