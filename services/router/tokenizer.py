"""The router's tokenizer: the model folder's Hugging Face tokenizer and chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidArgument


class Tokenizer:
    """Wraps ``AutoTokenizer`` of a model folder. Chat prompts are rendered with the folder's
    chat template (generation prompt appended) and tokenized without extra special tokens,
    as vLLM's OpenAI server does."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id
        self.max_model_len = _max_model_len(self.model_dir)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.decode([t]) for t in token_ids]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of ``messages`` in the model's chat template, with vLLM's options:
        ``template_kwargs`` are the template's own variables (``chat_template_kwargs``)."""
        from jinja2 import TemplateError

        if not getattr(self._tok, "chat_template", None):
            raise InvalidArgument("messages: this model has no chat template; send a prompt")
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except (ValueError, TypeError, TemplateError) as exc:  # e.g. its raise_exception
            raise InvalidArgument(f"messages: the chat template refused them: {exc}") from None
        return self.encode(text, add_special_tokens=add_special_tokens)


def _max_model_len(model_dir: Path) -> int:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(cfg.get("max_position_embeddings") or 0)
