"""The model revision is the weights' content: one changed byte, no shared key; same bytes
elsewhere, same fingerprint; a start with unchanged weights reads none of their bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pdserve.hashing import chunk_keys
from pdserve.model import file_digest
from pdserve.model.fingerprint import (
    adapter_identity,
    describe_revision,
    model_fingerprint,
    model_revision,
)

WEIGHTS = bytes(range(256)) * 64  # 16 KiB


def make_model(folder: Path, weights: bytes = WEIGHTS) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return folder


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file :func:`file_digest.hash_file` reads, in order."""
    reads: list[Path] = []
    real = file_digest.hash_file

    def counting(path: Path, size: int) -> str:
        reads.append(path)
        return real(path, size)

    monkeypatch.setattr(file_digest, "hash_file", counting)
    return reads


def test_one_weight_byte_changed_shares_no_key(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    flipped = bytearray(WEIGHTS)
    flipped[1000] ^= 1
    b = make_model(tmp_path / "b", bytes(flipped))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    fa, fb = (model_fingerprint(d, "same-name", "float32", 4) for d in (a, b))
    assert fa.revision != fb.revision and fa.digest() != fb.digest()
    tokens = list(range(64))
    assert not set(chunk_keys(fa, tokens)) & set(chunk_keys(fb, tokens))


def test_same_bytes_elsewhere_same_fingerprint(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    first = model_fingerprint(a, "m", "float32", 4)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "deeper" / "b")  # the cache file too
    assert (copy / file_digest.CACHE_NAME).is_file()
    assert model_fingerprint(copy, "m", "float32", 4) == first
    fresh = make_model(tmp_path / "c")  # no cache file at all
    assert model_fingerprint(fresh, "m", "float32", 4).digest() == first.digest()


def test_second_start_reads_no_weight_bytes(tmp_path: Path, hashed: list[Path]) -> None:
    a = make_model(tmp_path / "a")
    first = model_revision(a)
    assert hashed == [a / "model.safetensors"]
    assert model_revision(a) == first
    assert hashed == [a / "model.safetensors"]  # the cache answered
    cache = json.loads((a / file_digest.CACHE_NAME).read_text())
    entry = cache["files"][str((a / "model.safetensors").resolve())]
    assert entry["size"] == len(WEIGHTS) and len(entry["blake3"]) == 64


def test_a_byte_rewritten_in_place_with_mtime_restored_is_seen(
    tmp_path: Path, hashed: list[Path]
) -> None:
    a = make_model(tmp_path / "a")
    weights = a / "model.safetensors"
    before = model_revision(a)
    st = weights.stat()
    with weights.open("r+b") as f:  # same inode, same size
        f.seek(5)
        f.write(b"\xff")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_ino == st.st_ino
    assert model_revision(a) != before
    assert len(hashed) == 2


def test_a_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    before = model_revision(a)
    entry = str((a / "model.safetensors").resolve())
    (a / file_digest.CACHE_NAME).write_text(json.dumps({"format": 1, "files": {entry: 7}}))
    assert model_revision(a) == before
    (a / file_digest.CACHE_NAME).write_text("{not json")
    assert model_revision(a) == before


def test_read_only_folder_caches_under_the_pdserve_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: list[Path]
) -> None:
    a = make_model(tmp_path / "a")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(
        file_digest.os, "access", lambda p, m: False if Path(p) == a else real_access(p, m)
    )
    first = model_revision(a)
    assert not (a / file_digest.CACHE_NAME).exists()
    assert (tmp_path / "cache" / file_digest.SHARED_CACHE_NAME).is_file()
    assert model_revision(a) == first and len(hashed) == 1


def test_what_enters_the_revision(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    before = describe_revision(a)
    assert [name for name, _ in before.weights] == ["model.safetensors"]
    assert before.config and not before.hub_commit
    (a / "tokenizer.json").write_text('{"version": "2.0"}')  # token ids key the chain
    (a / "generation_config.json").write_text('{"temperature": 0.1}')
    assert model_revision(a) == before.revision
    (a / "config.json").write_text(json.dumps({"hidden_size": 64, "model_type": "llama"}))
    assert model_revision(a) == before.revision  # canonicalised: key order does not count
    (a / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65}))
    assert model_revision(a) != before.revision
    (a / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (a / "extra.pt").write_bytes(b"more weights")
    assert model_revision(a) != before.revision


def test_a_hub_snapshot_commit_joins_the_revision(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = make_model(tmp_path / "models--org--name" / "snapshots" / commit)
    plain = make_model(tmp_path / "plain")
    described = describe_revision(snap)
    assert described.hub_commit == commit
    assert described.revision != model_revision(plain)


def test_not_a_model_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        model_revision(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no config\.json and no weight file"):
        model_revision(tmp_path)


def test_adapter_identity_is_name_and_content(tmp_path: Path, hashed: list[Path]) -> None:
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"r": 8}')
    (lora / "adapter_model.safetensors").write_bytes(WEIGHTS)
    ident = adapter_identity("sql", str(lora))
    name, _, digest = ident.partition(":")
    assert name == "sql" and len(digest) == 32
    reads = len(hashed)
    assert adapter_identity("sql", str(lora)) == ident and len(hashed) == reads  # cached
    assert adapter_identity("other", str(lora)) == f"other:{digest}"
    copy = shutil.copytree(lora, tmp_path / "x" / "lora")
    assert adapter_identity("sql", str(copy)) == ident
    (copy / ".hidden").write_text("editor state")  # dot files are not the adapter
    assert adapter_identity("sql", str(copy)) == ident
    flipped = bytearray(WEIGHTS)
    flipped[0] ^= 1
    (copy / "adapter_model.safetensors").write_bytes(bytes(flipped))
    assert adapter_identity("sql", str(copy)) != ident
    single = adapter_identity("sql", str(lora / "adapter_model.safetensors"))
    assert single.startswith("sql:") and single != ident
    with pytest.raises(ValueError, match="must not be empty"):
        adapter_identity("", str(lora))
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        adapter_identity("sql", str(tmp_path / "missing"))


def test_a_large_file_shows_a_progress_bar_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = make_model(tmp_path / "a") / "model.safetensors"
    quiet = file_digest.hash_file(weights, len(WEIGHTS))
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(file_digest, "PROGRESS_MIN_BYTES", 1)
    monkeypatch.setattr(file_digest, "READ_BLOCK", 4096)  # several updates
    monkeypatch.setattr(file_digest.sys.stderr, "isatty", lambda: True)
    assert file_digest.hash_file(weights, len(WEIGHTS)) == quiet
    assert "hashing model.safetensors" in capsys.readouterr().err
