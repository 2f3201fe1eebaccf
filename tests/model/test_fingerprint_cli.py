"""``pdserve model fingerprint`` prints the digest a worker derives and what went into it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.commands.cli import main
from pdserve.model.fingerprint import model_fingerprint
from pdserve.model.kv_options import kv_options


def make_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model-00001.safetensors").write_bytes(b"\x02" * 1000)
    (folder / "model-00002.safetensors").write_bytes(b"\x03" * 1000)
    return folder


def test_json_report_is_the_workers_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path / "m")
    argv = ["model", "fingerprint", str(model), "--served-name", "smollm2", "--json"]
    argv += ["--kv-dtype", "bfloat16", "--chunk-size", "32", "--vllm-arg", 'quantization="fp8"']
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    options = kv_options({"quantization": "fp8"}, model)
    fp = model_fingerprint(model, "smollm2", "bfloat16", 32, options=options)
    assert report["fingerprint"] == fp.digest().hex()
    assert report["revision"] == fp.revision and report["options"] == 'quantization="fp8"'
    assert sorted(report["weights"]) == ["model-00001.safetensors", "model-00002.safetensors"]
    assert all(len(d) == 64 for d in report["weights"].values())
    assert (report["chunk_size"], report["kv_dtype"], report["hub_commit"]) == (32, "bfloat16", "")


def test_text_report_and_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model(tmp_path / "m")
    assert main(["model", "fingerprint", str(model)]) == 0
    out = capsys.readouterr().out
    fp = model_fingerprint(model, str(model), "float32", 256)
    assert f"fingerprint     {fp.digest().hex()}" in out
    assert out.count("\nweight ") == 2 and "options         -" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vllm-arg", "quantization=fp8"], "is not JSON"),
        (["--vllm-arg", "quantization"], "expected NAME=JSON"),
        (["--chunk-size", "0"], "chunk_size must be positive"),
    ],
)
def test_bad_input_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    model = make_model(tmp_path / "m")
    assert main(["model", "fingerprint", str(model), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fingerprint", str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err
