"""A small random LoRA adapter in peft's on-disk format, written by hand (peft is not a
dependency): ``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight``. lora_B is
nonzero (peft initialises it to zero, which would change nothing), so the adapter changes every
layer's K and V: KV computed through it differs from the base model's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_lora_adapter(model_dir: Path, out: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Writes a rank-``rank`` adapter for the Llama model in ``model_dir`` into ``out`` (the
    same ``seed`` gives the same bytes) and returns ``out``. The scale ``lora_alpha / rank``
    is 2 and the factors are drawn so the delta is of the weights' order, not noise."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    shapes = {  # (in, out) features of each projection
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for proj in PROJECTIONS:
            fan_in, fan_out = shapes[proj]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) / rank**0.5 * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out
