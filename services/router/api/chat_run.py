"""One chat generation through the router with its answer parsed: what the chat completions
endpoint runs for a request with tools or a reasoning parser, and what /v1/responses and
/v1/messages run for every request (they are chat requests in another shape, so their text is
the chat endpoint's, token for token).

:meth:`ChatRun.start` validates the chat body and opens the generation: every input and
admission error surfaces there, before any byte is answered. Then either :meth:`ChatRun.whole`
(the parsed answer) or :meth:`ChatRun.deltas` (the chat stream's deltas, vLLM's streaming
parse) and :attr:`ChatRun.turn` once they are done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.services.router import request as rq
from pdserve.services.router.api.parsers import ChatParse
from pdserve.services.router.frontend import Frontend
from pdserve.services.router.stream import StreamChunk
from pdserve.v1 import common_pb2

#: The worker's finish reasons as OpenAI's finish_reason.
FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
}


@dataclass
class Turn:
    """A finished generation: its parsed parts, OpenAI finish_reason and token counts."""

    content: str | None
    reasoning: str | None
    #: OpenAI chat tool calls: ``{id, type: function, function: {name, arguments}}``.
    tool_calls: list[dict[str, Any]]
    finish: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def message(self) -> dict[str, Any]:
        """The chat completions ``message`` (``reasoning`` as vLLM names it, and
        ``reasoning_content``, its earlier name)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        out["tool_calls"] = self.tool_calls
        return out

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ChatRun:
    fe: Frontend
    req: rq.GenRequest
    parse: ChatParse | None
    chunks: AsyncIterator[tuple[int, StreamChunk]]
    first: StreamChunk | None
    #: Set once the generation is consumed (:meth:`whole` or :meth:`deltas`).
    turn: Turn | None = None
    _text: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)

    @classmethod
    async def start(cls, fe: Frontend, body: dict[str, Any]) -> ChatRun:
        """Validates the chat completions ``body`` (off the event loop: templating and the
        parsers' first load take a while) and opens its generation on the frontend of its
        ``model`` (``run.fe``); raises what the chat endpoint would answer as an error."""
        fe = fe.for_model(body.get("model"))
        reqs, parse = await asyncio.to_thread(fe.from_openai_parsed, body, chat=True)
        return await cls.open(fe, reqs[0], parse)

    @classmethod
    async def open(cls, fe: Frontend, req: rq.GenRequest, parse: ChatParse | None) -> ChatRun:
        """Opens the generation of the validated ``req``: admission and worker errors raise
        here, before its first chunk."""
        chunks = fe.generate_n([req], 1)
        try:
            _, first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await chunks.aclose()
            raise
        return cls(fe, req, parse, chunks, first)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    async def _pieces(self) -> AsyncIterator[StreamChunk]:
        async with contextlib.aclosing(self.chunks):
            if self.first is not None:
                yield self.first
            async for _, c in self.chunks:
                yield c

    async def whole(self) -> Turn:
        """Runs the generation to its end; its parsed answer."""
        counts = _Counts()
        async for c in self._pieces():
            counts.add(c)
            self._text.append(c.text)
            self._ids.extend(c.token_ids)
        text = "".join(self._text)
        if self.parse is None:
            reasoning, content, calls = None, text, []
        else:
            reasoning, content, calls = self.parse.parse(text, self._ids)
        self.turn = counts.turn(content, reasoning, calls, self.parse)
        return self.turn

    async def deltas(self) -> AsyncIterator[dict[str, Any]]:
        """The chat stream's deltas (``content``, ``reasoning``, ``tool_calls``) as vLLM's
        streaming parser cuts them; :attr:`turn` is set after the last (its content and
        reasoning what was streamed, its tool calls the whole text's)."""
        counts = _Counts()
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        prompt = self.req.prompt_token_ids
        async for c in self._pieces():
            counts.add(c)
            self._text.append(c.text)
            self._ids.extend(c.token_ids)
            done = bool(c.finish)
            if self.parse is None:
                delta = {"content": c.text} if c.text else None
            else:
                delta = self.parse.delta(c.text, c.token_ids, prompt, finished=done)
            if delta:
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning") or "")
                yield delta
        if self.parse is not None and self.parse.parser is not None:
            calls = self.parse.parse("".join(self._text), self._ids)[2]
        text = "".join(content)
        self.turn = counts.turn(
            text if text or not calls else None,
            "".join(reasoning) if any(reasoning) else None,
            calls,
            self.parse,
        )


class _Counts:
    """Token counts and the finish reason of a generation's chunks."""

    def __init__(self) -> None:
        self.prompt = self.cached = self.completion = 0
        self.finish = "stop"

    def add(self, c: StreamChunk) -> None:
        if c.prompt_tokens:
            self.prompt, self.cached = c.prompt_tokens, c.cached_tokens
        self.completion += len(c.token_ids)
        if c.finish:
            self.finish = FINISH.get(c.finish, "stop")

    def turn(
        self,
        content: str | None,
        reasoning: str | None,
        calls: list[dict[str, Any]],
        parse: ChatParse | None,
    ) -> Turn:
        finish = parse.finish_reason(self.finish, len(calls)) if parse else self.finish
        return Turn(content, reasoning, calls, finish, self.prompt, self.completion, self.cached)
