"""The torch engine's model runner: a Hugging Face transformers causal LM in fp32 on the CPU,
its tokenizer and shapes, one forward pass, and the per-request KV cache (a transformers
``DynamicCache``) turned into and built from canonical chunks
``[layers, 2, kv_heads, tokens, head_dim]``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.engines.config import EngineConfig

log = logging.getLogger(__name__)

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchModel:
    """The loaded model (:meth:`load`, blocking). ``kv_dtype``: the dtype chunks are stored
    and read back in (the engine's resolved ``kv_dtype``); the cache itself is float32.
    Used by the model's thread only, but for the read-only shapes and the tokenizer."""

    def __init__(self, cfg: EngineConfig, path: Path, tokenizer: Any, hf: Any) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.hf = hf
        conf = hf.config
        self.num_layers: int = conf.num_hidden_layers
        self.num_kv_heads: int = conf.num_key_value_heads
        self.head_dim: int = getattr(conf, "head_dim", None) or conf.hidden_size // (
            conf.num_attention_heads
        )
        self.vocab_size: int = conf.vocab_size
        limit = conf.max_position_embeddings
        self.max_model_len: int = min(cfg.max_model_len or limit, limit)
        eos = tokenizer.eos_token_id
        if eos is None:
            eos = conf.eos_token_id[0] if isinstance(conf.eos_token_id, list) else conf.eos_token_id
        self.eos_token_id = int(eos)
        self.kv_dtype = KV_DTYPES[cfg.resolved_kv_dtype()]
        #: KV bytes per token as the DynamicCache holds it (float32 K and V per layer)
        self.kv_token_bytes = 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def load(cls, cfg: EngineConfig) -> TorchModel:
        """Resolves ``cfg.model`` to a local folder and loads the tokenizer and the weights."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pdserve.model.prepare import resolve_model

        torch.set_num_threads(cfg.torch_threads)
        path = Path(resolve_model(cfg.model))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        model = cls(cfg, path, tokenizer, hf)
        log.info(
            "torch engine: model %s from %s, %d layers, %d kv heads, head_dim %d, max_model_len %d",
            cfg.served_name(),
            path,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            model.max_model_len,
        )
        return model

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_text(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    def forward(self, ids: Sequence[int], cache: Any) -> torch.Tensor:
        """Runs ``ids`` after what ``cache`` holds; returns the last position's logits."""
        out = self.hf(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def chunk_of(self, cache: Any, start: int, end: int) -> torch.Tensor:
        """Canonical ``[layers, 2, kv_heads, end - start, head_dim]`` KV of positions
        ``[start, end)``, in ``kv_dtype``."""
        kv = torch.stack(
            [
                torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                for layer in cache.layers
            ]
        )
        return kv.to(self.kv_dtype).contiguous()

    def cache_from_chunks(self, chunks: Sequence[torch.Tensor], num_tokens: int) -> Any:
        """A cache holding the first ``num_tokens`` positions of the concatenated chunks."""
        cache = self.new_cache()
        if not chunks or num_tokens == 0:
            return cache
        kv = torch.cat(list(chunks), dim=3)[:, :, :, :num_tokens].to(torch.float32)
        for i in range(self.num_layers):
            cache.update(kv[i, 0].unsqueeze(0).clone(), kv[i, 1].unsqueeze(0).clone(), i)
        return cache

    def valid_chunk(self, kv: torch.Tensor | None, tokens: int) -> bool:
        """Whether ``kv`` is a chunk of ``tokens`` positions of this model, in ``kv_dtype``."""
        return (
            kv is not None
            and kv.dtype == self.kv_dtype
            and tuple(kv.shape) == (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)
        )

    def truncated(self, cache: Any, num_tokens: int) -> Any:
        """A cache holding only the first ``num_tokens`` positions of ``cache``."""
        if cache.get_seq_length() <= num_tokens:
            return cache
        out = self.new_cache()
        for i, layer in enumerate(cache.layers):
            out.update(
                layer.keys[:, :, :num_tokens].clone(), layer.values[:, :, :num_tokens].clone(), i
            )
        return out
