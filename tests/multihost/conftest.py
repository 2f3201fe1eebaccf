"""Fixtures for the multi-host tests: the tiny model folder and the single-process HF greedy
reference the cluster's output must match token for token."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The prepared tiny model (the same folder ``--model tiny`` resolves to in the services)."""
    from pdserve.model.prepare import resolve_model

    return Path(resolve_model("tiny"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """Ground truth: a plain transformers greedy loop in this process, stopping after EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    eos = model.config.eos_token_id

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> list[int]:
        out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        toks: list[int] = []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
            if tok == eos:
                break
            out = model(
                input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True
            )
        return toks

    return run
