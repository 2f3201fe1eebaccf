"""Every field of an OpenAI completions / chat completions / responses body and of an Anthropic
messages body, as OpenAI's, Anthropic's and vLLM's request models name them (the ``openai`` and
``anthropic`` packages' ``*CreateParams`` TypedDicts and vLLM's ``CompletionRequest`` /
``ChatCompletionRequest`` / ``ResponsesRequest`` / ``AnthropicMessagesRequest``;
tests/router/test_openai_fields.py keeps this table covering them all): each is honoured,
accepted because it cannot change the answer, or refused with its reason unless it holds its
default. A field none of them has is refused with a 400 naming it (OpenAI's own API does the
same), with the closest known name when there is one.
"""

from __future__ import annotations

from typing import Any

from pdserve.errors import InvalidArgument, did_you_mean

#: Fields both APIs honour (frontend.py reads them).
_SHARED = frozenset({
    "model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "logprobs", "response_format", "cache_salt",
    "request_id", "truncate_prompt_tokens", "add_special_tokens", "min_tokens",
    "skip_special_tokens", "priority",
})  # fmt: skip
#: Honoured fields of /v1/completions.
COMPLETIONS = _SHARED | {"prompt", "echo"}
#: Honoured fields of /v1/chat/completions.
CHAT = _SHARED | {
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "tools", "tool_choice",
    "parallel_tool_calls", "include_reasoning",
}  # fmt: skip
#: Honoured fields of /v1/responses (api/responses.py turns them into a chat request).
RESPONSES = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "stream",
    "text", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "stop_token_ids", "cache_salt", "request_id",
    "include_reasoning", "skip_special_tokens", "chat_template_kwargs",
}  # fmt: skip
#: Honoured fields of /v1/messages, Anthropic's shape (api/messages.py).
MESSAGES = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
    "top_k", "stream", "tools", "tool_choice", "cache_salt", "chat_template_kwargs",
}  # fmt: skip
#: Each API's path and honoured fields.
APIS = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}

#: Accepted with any value: they describe the caller or hint at caching, and change no token.
ACCEPTED: dict[str, str] = {
    "user": "an end-user id for the caller's records",
    "safety_identifier": "an end-user id for the caller's records",
    "metadata": "tags for stored completions",
    "prompt_cache_key": "pdserve finds shared prefixes by their tokens",
    "prompt_cache_retention": "pdserve keeps prefixes while the store has room",
    "stream_interval": "pdserve streams each token as it comes",
    "user_profile_id": "an end-user id for the caller's records",
    "workspace_id": "the caller's records",
    "diagnostics": "the caller's records",
}

#: Refused unless they hold one of these values (their defaults in OpenAI's or vLLM's model):
#: name -> (accepted values, why the others are refused).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "tools are a chat completions field"),
    "tool_choice": ((None, "none"), "tools are a chat completions field"),
    "parallel_tool_calls": ((None, True, False), "tools are a chat completions field"),
    "functions": ((None, []), "deprecated by OpenAI: use tools"),
    "function_call": ((None, "none"), "deprecated by OpenAI: use tools and tool_choice"),
    "best_of": ((None, 1), "best_of > 1 is not supported (as in vLLM V1); use n"),
    "use_beam_search": ((None, False), "no beam search (as in vLLM V1's OpenAI server)"),
    "length_penalty": ((None, 1, 1.0), "beam search only"),
    "suffix": ((None, ""), "no fill-in-the-middle"),
    "echo": ((None, False), "chat echo is not implemented (completions echo is)"),
    "min_p": ((None, 0, 0.0), "not implemented"),
    "prompt_logprobs": ((None,), "prompt logprobs are not computed"),
    "logprob_token_ids": ((None, []), "not implemented"),
    "include_stop_str_in_output": ((None, False), "not implemented"),
    "allowed_token_ids": ((None, []), "not implemented"),
    "bad_words": ((None, []), "not implemented"),
    "spaces_between_special_tokens": ((None, True), "the tokenizer's own spacing is kept"),
    "truncation_side": ((None, "left"), "prompts are truncated on the left only"),
    "return_token_ids": ((None, False), "not implemented"),
    "return_tokens_as_token_ids": ((None, False), "not implemented"),
    "return_token_offsets": ((None, False), "not implemented"),
    "return_prompt_text": ((None, False), "not implemented"),
    "structured_outputs": ((None,), "use response_format"),
    "guided_json": ((None,), "use response_format"),
    "guided_regex": ((None,), "not implemented"),
    "guided_choice": ((None,), "not implemented"),
    "guided_grammar": ((None,), "not implemented"),
    "chat_template": ((None,), "the model's own chat template only"),
    "documents": ((None, []), "no retrieval-augmented templates"),
    "include_reasoning": ((None, True), "a chat completions and responses field"),
    "reasoning_effort": ((None,), "not implemented (set chat_template_kwargs)"),
    "thinking_token_budget": ((None,), "not implemented"),
    "verbosity": ((None,), "not implemented"),
    "web_search_options": ((None,), "no web search"),
    "moderation": ((None,), "no moderation"),
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "prompt_cache_options": ((None,), "not implemented"),
    "audio": ((None,), "text only"),
    "modalities": ((None, ["text"]), "text only"),
    "prediction": ((None,), "no predicted outputs"),
    "prompt_embeds": ((None,), "text and token ids only"),
    "mm_payload": ((None, "tensors"), "text only"),
    "mm_processor_kwargs": ((None,), "text only"),
    "media_io_kwargs": ((None,), "text only"),
    "return_mm_kwargs": ((None, False), "text only"),
    "kv_transfer_params": ((None,), "pdserve moves the KV cache itself"),
    "ec_transfer_params": ((None,), "pdserve moves the KV cache itself"),
    "vllm_xargs": ((None,), "not implemented"),
    "session_id": ((None,), "not implemented"),
    "watermarking": ((None,), "not implemented"),
    "repetition_detection": ((None,), "not implemented"),
    "routed_experts_prompt_start": ((None, 0), "not implemented"),
    # /v1/responses
    "include": ((None, []), "no extra output data"),
    "background": ((None, False), "no background responses"),
    "background_options": ((None,), "no background responses"),
    "conversation": ((None,), "no conversations: use previous_response_id"),
    "context_management": ((None,), "not implemented"),
    "max_tool_calls": ((None,), "not implemented"),
    "truncation": ((None, "disabled"), "an input over the context is refused"),
    "reasoning": ((None,), "no reasoning effort (a reasoning parser only splits the output)"),
    "access_programs": ((None,), "not implemented"),
    "image": ((None,), "text only"),
    "previous_input_messages": ((None,), "use previous_response_id"),
    "enable_response_messages": ((None, False), "not implemented"),
    # /v1/messages
    "thinking": ((None,), "no thinking blocks"),
    "container": ((None,), "no code execution"),
    "output_config": ((None,), "use tools and tool_choice"),
    "cache_control": ((None,), "pdserve finds shared prefixes by their tokens"),
    "inference_geo": ((None,), "one location"),
    "speed": ((None,), "one speed"),
}


#: Refused by one API only, where another honours the same name: API -> ``REFUSED``'s form.
REFUSED_IN: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "/v1/responses": {
        "prompt": ((None,), "no stored prompt templates"),
        "top_logprobs": ((None, 0), "no logprobs in /v1/responses output; use chat completions"),
        "stream_options": ((None,), "not implemented in /v1/responses"),
        "priority": ((None, 0), "priority is honoured on completions and chat completions"),
    },
}


def known(api: str) -> set[str]:
    """Every field name ``api`` honours, accepts or refuses with a reason."""
    return APIS[api] | ACCEPTED.keys() | REFUSED.keys() | REFUSED_IN.get(api, {}).keys()


def check_fields(body: dict[str, Any], *, chat: bool = False, api: str = "") -> None:
    """Refuses (400, naming the field) a field the API (``api``, else chat or completions) does
    not have, and a field pdserve does not implement set to anything but its default."""
    api = api or ("/v1/chat/completions" if chat else "/v1/completions")
    honoured = APIS[api]
    refused = {**REFUSED, **REFUSED_IN.get(api, {})}
    for name, value in body.items():
        if name in honoured or name in ACCEPTED:
            continue
        if name in refused:
            off, why = refused[name]
            if not any(value == v and type(value) is type(v) for v in off):
                raise InvalidArgument(
                    f"{name}: not supported by this server ({why}; got {value!r:.100}); "
                    "leave it unset",
                    param=name,
                )
            continue
        if any(name in fields for fields in APIS.values()):
            raise InvalidArgument(f"{name}: not a field of {api}", param=name)
        known = sorted(honoured | ACCEPTED.keys() | REFUSED.keys())
        raise InvalidArgument(
            f"{str(name)!r:.60}: unknown field of {api}{did_you_mean(name, known)}; OpenAI's and "
            "vLLM's APIs have "
            "no such field",
            param=str(name)[:60],
        )


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false, got {value!r:.40}", param=name)
    return value


#: Keywords of the tokenizer's apply_chat_template that chat_template_kwargs may not set.
_TEMPLATE_OWN = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                           "continue_final_message", "chat_template", "tools", "documents"})  # fmt: skip


def chat_options(body: dict[str, Any], msgs: list[dict[str, str]]) -> dict[str, Any]:
    """vLLM's chat templating options of ``body``, validated as vLLM validates them."""
    generation = flag(body, "add_generation_prompt", True)
    cont = flag(body, "continue_final_message", False)
    if cont and generation:
        raise InvalidArgument(
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt: false to continue the last message)",
            param="continue_final_message",
        )
    if cont and msgs[-1]["role"] != "assistant":
        raise InvalidArgument(
            "continue_final_message needs an assistant message last", param="continue_final_message"
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgument(
            "chat_template_kwargs must be an object of template variables",
            param="chat_template_kwargs",
        )
    own = sorted(_TEMPLATE_OWN & kwargs.keys())
    if own:
        raise InvalidArgument(
            f"chat_template_kwargs may not set {own}: they are the request's own fields or "
            "not supported",
            param="chat_template_kwargs",
        )
    return {
        "add_generation_prompt": generation,
        "continue_final_message": cont,
        "add_special_tokens": flag(body, "add_special_tokens", False),
        "template_kwargs": kwargs,
    }


def truncate(ids: list[int], keep: Any, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: only the prompt's last ``keep`` tokens (-1: as many
    as the context holds; unset: no truncation)."""
    if keep is None:
        return ids
    if isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1):
        raise InvalidArgument(
            f"truncate_prompt_tokens must be -1 or a positive integer, got {keep!r:.40}",
            param="truncate_prompt_tokens",
        )
    if keep == -1:
        keep = max_model_len or len(ids)
    elif max_model_len and keep > max_model_len:
        raise InvalidArgument(
            f"truncate_prompt_tokens {keep} is over the model's {max_model_len}-token context",
            param="truncate_prompt_tokens",
        )
    return ids[-keep:]
