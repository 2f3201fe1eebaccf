"""The deterministic tiny Llama: same bytes every build, loads and generates in transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.model.prepare import MARKER, TINY, build_tiny_model, model_dir, read_marker


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_two_builds_write_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other-cache")
    assert other != tiny_dir
    first, second = _hashes(tiny_dir), _hashes(other)
    assert "model.safetensors" in first
    assert first["model.safetensors"] == second["model.safetensors"]
    assert first == second


def test_folder_has_everything_loaders_need(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER,
    } <= names
    assert not any(n.startswith(".") for n in names)
    marker = read_marker(tiny_dir)
    assert marker is not None and marker["name"] == TINY
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config


def test_loads_and_generates_greedily(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 2)
    assert (cfg.head_dim, cfg.num_hidden_layers, cfg.intermediate_size) == (32, 2, 256)
    assert cfg.max_position_embeddings == 4096
    assert len(tok) <= cfg.vocab_size

    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == cfg.eos_token_id == model.generation_config.eos_token_id
    special_ids = [
        tok(special, add_special_tokens=False).input_ids
        for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    ]
    assert all(len(ids) == 1 for ids in special_ids)
    assert len({ids[0] for ids in special_ids}) == 3

    text = "Once upon a time the girl read a book by the sea."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"

    inputs = tok("Once upon a time", return_tensors="pt")
    n = inputs.input_ids.shape[1]
    with torch.no_grad():
        out1 = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        out2 = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        # The greedy tokens are the argmax of a plain forward pass over the same prefix.
        logits = model(input_ids=out1[:, :-1]).logits
    assert out1.shape[1] > n
    assert torch.equal(out1, out2)
    assert torch.equal(logits[0, n - 1 :].argmax(-1), out1[0, n:])


def test_complete_folder_is_reused_and_force_rebuilds(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path)
    inode, hashes = first.stat().st_ino, _hashes(first)
    assert build_tiny_model(tmp_path) == first
    assert first.stat().st_ino == inode  # same folder, not rebuilt
    rebuilt = build_tiny_model(tmp_path, force=True)
    assert rebuilt == first
    assert rebuilt.stat().st_ino != inode  # a new folder was renamed into place
    assert _hashes(rebuilt) == hashes
    assert [p.name for p in (tmp_path / "models").iterdir()] == [TINY]  # no temp leftovers


def test_incomplete_folder_is_replaced(tmp_path: Path) -> None:
    target = model_dir(TINY, tmp_path)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half-written")
    build_tiny_model(tmp_path)
    assert read_marker(target) is not None
    assert (target / "model.safetensors").stat().st_size > 1_000_000
