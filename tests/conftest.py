"""Fixtures shared by every test area: the tiny model and the single-process ground truth."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny Llama (built once into the model cache)."""
    from pdserve.model.prepare import build_tiny_model

    return Path(build_tiny_model())


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """``hf_greedy(prompt_ids, n)``: the first ``n`` greedy tokens of a plain transformers loop
    in this process (whole prompt in one forward, then one token at a time), stopping after
    EOS. The ground truth every disaggregated path must match token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    eos = model.config.eos_token_id

    @torch.inference_mode()
    def run(prompt: Sequence[int], n: int) -> list[int]:
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
