"""``pdserve model prepare`` on the real SmolLM2 GGUF, through the real CLI (slow: ~30 s)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.model.prepare import MARKER, SMOLLM2

#: Common English words; a continuation of real English hits several of them.
# fmt: off
COMMON_WORDS = frozenset([
    "a", "an", "the", "and", "or", "but", "of", "to", "in", "on", "at", "by", "for", "with",
    "from", "as", "is", "was", "were", "be", "been", "it", "its", "he", "she", "they", "we",
    "you", "i", "his", "her", "their", "there", "this", "that", "these", "who", "which", "what",
    "when", "where", "had", "has", "have", "not", "no", "so", "very", "one", "all",
])
# fmt: on


def _prepare(cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.commands.cli",
            "model",
            "prepare",
            "--cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_prepare_smollm2_via_cli_then_generate_english(tmp_path: Path) -> None:
    first = _prepare(tmp_path)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / "models" / SMOLLM2
    assert "dequantizing" in first.stderr  # progress was shown

    marker = json.loads((folder / MARKER).read_text())
    assert marker["name"] == SMOLLM2
    assert re.fullmatch(r"[0-9a-f]{64}", marker["source_sha256"])
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)
    assert not list(folder.glob("*.gguf"))

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    ).eval()
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == model.generation_config.eos_token_id
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    inputs = tok("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    assert letters >= 0.85 * len(text) and len(text) >= 30, text
    words = re.findall(r"[a-z]+", text.lower())
    assert len(set(words) & COMMON_WORDS) >= 3, text

    inode = (folder / "model.safetensors").stat().st_ino
    second = _prepare(tmp_path)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip().splitlines()[-1]) == folder
    assert "dequantizing" not in second.stderr  # reused: nothing was loaded or written
    assert (folder / "model.safetensors").stat().st_ino == inode
