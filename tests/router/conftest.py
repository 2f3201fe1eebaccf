"""Fixtures for the router tests (the fakes live in router_fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from pdserve.model.prepare import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """Single-process ground truth: a plain transformers greedy loop, stopping after EOS."""
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


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model in the default cache (shared with the worker processes)."""
    from pdserve.model.prepare import build_tiny_model

    return build_tiny_model()
