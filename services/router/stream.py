"""Stream: what the client gets (:class:`StreamChunk`) from the decode workers' messages, across
attempts (:class:`DecodeSession`: a retry before the first token, a resume after it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.requests import TokenLogprob
from pdserve.requests_codec import logprobs_from_proto
from pdserve.services.router.trace import CACHED, Trace
from pdserve.services.router.worker_client import DecodeCall
from pdserve.services.router.worker_requests import resumed_request
from pdserve.v1 import common_pb2, engine_pb2


@dataclass
class StreamChunk:
    """Tokens for the client; ``finish`` is set on the last chunk only."""

    token_ids: list[int]
    text: str
    times_ms: list[float]
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: One per token of ``token_ids`` when the request asked logprobs, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)


class DecodeSession:
    """One generation streamed from decode workers, across attempts (a retry before the first
    token, a resume after it): the request of the next attempt, what the client has got, and
    the prompt counts it gets once, with the first chunk."""

    def __init__(
        self,
        request: engine_pb2.DecodeRequest,
        trace: Trace,
        *,
        cached_tokens: int | None,
        prefill: asyncio.Future | None = None,
        first_logprob: TokenLogprob | None = None,
    ) -> None:
        self.request = request
        #: Prefill's first token's logprobs: the worker echoes that token without them.
        self.first_logprob = first_logprob
        self.trace = trace
        self._first_request = request
        #: Prompt tokens the client is told were cached: fixed by the plan, or None when the
        #: decode worker prefills (local plan) and its own counts tell.
        self.cached_tokens = cached_tokens
        self.reported = False
        #: Tokens streamed to the client across attempts, their text as streamed, and text a
        #: failed worker held back (a partial character), owed to the client.
        self.emitted: list[int] = []
        self.sent_text = ""
        self.pending_text = ""
        #: Messages of this attempt still to come that echo prefill's first token.
        self.echoes = 1 if request.HasField("first_token_id") else 0
        #: Write plan: the parallel prefill. Failing before decode's first token means no
        #: chunk will land: the watched call is cancelled and ``prefill_failed`` set.
        self.prefill = prefill
        self.prefill_failed = False
        self._watched: DecodeCall | None = None

    @property
    def local(self) -> bool:
        """The attempt's worker prefills the whole prompt itself (no KV handle)."""
        return not self.request.HasField("kv")

    def watch(self, call: DecodeCall) -> None:
        """Cancels ``call`` when the prefill fails, until :meth:`unwatch`."""
        if self.prefill is not None:
            self._watched = call
            self.prefill.add_done_callback(self._on_prefill)

    def unwatch(self) -> None:
        if self.prefill is not None and self._watched is not None:
            self._watched = None
            self.prefill.remove_done_callback(self._on_prefill)

    def _on_prefill(self, fut: asyncio.Future) -> None:
        if self._watched is None:
            return
        if fut.cancelled() or fut.exception() is not None or fut.result() is None:
            self.prefill_failed = True
            self._watched.cancel()

    def on_response(self, resp: engine_pb2.DecodeResponse) -> StreamChunk:
        """The client's chunk for one decode message; records the worker's counts."""
        trace = self.trace
        if not self.echoes and not trace.decode_first:
            trace.decode_first = time.monotonic()
        logprobs = logprobs_from_proto(resp.logprobs) if resp.HasField("logprobs") else []
        if self.echoes and resp.token_ids and self.first_logprob is not None:
            logprobs.insert(0, self.first_logprob)
        self.echoes = max(0, self.echoes - 1)
        # Decode reports its prompt counts on its last message only (DecodeResponse), so the
        # client's first chunk gets them only when it is also the last.
        counted = resp.loaded_tokens or resp.recomputed_tokens or resp.prefix_cached_tokens
        if counted:
            trace.decode_loaded = resp.loaded_tokens
            trace.decode_recomputed = resp.recomputed_tokens
            trace.decode_prefix_cached = resp.prefix_cached_tokens
            if self.local:
                CACHED.labels("store").inc(resp.loaded_tokens)
                CACHED.labels("prefix_cache").inc(resp.prefix_cached_tokens)
                CACHED.labels("computed").inc(resp.recomputed_tokens)
        if resp.token_times_ms:
            trace.decode_worker_ms = resp.token_times_ms[-1]
        text = self.pending_text + resp.text
        self.pending_text = ""
        self.emitted.extend(resp.token_ids)
        self.sent_text += text
        chunk = StreamChunk(list(resp.token_ids), text, [], resp.finish_reason, logprobs=logprobs)
        if not self.reported:
            self.reported = True
            chunk.prompt_tokens = len(self._first_request.prompt_token_ids)
            if self.cached_tokens is not None:
                chunk.cached_tokens = self.cached_tokens
            elif counted:
                chunk.cached_tokens = resp.loaded_tokens + resp.prefix_cached_tokens
            else:  # not known yet: what the store held at routing time
                chunk.cached_tokens = trace.cached_tokens
        elif counted and self.cached_tokens is None:
            # the worker's own count (its prefix cache, the store's loads) came with its last
            # message: given again there, for the usage reported at the end
            chunk.prompt_tokens = len(self._first_request.prompt_token_ids)
            chunk.cached_tokens = resp.loaded_tokens + resp.prefix_cached_tokens
        return chunk

    def resume(self, detokenize: Callable[[list[int]], str]) -> bool:
        """Makes the next attempt continue after the tokens already streamed
        (:func:`~pdserve.services.router.worker_requests.resumed_request`); text the failed
        worker held back is re-derived from the tokens. False when it cannot be resumed (no
        max_tokens, or nothing left)."""
        request = resumed_request(self._first_request, self.emitted)
        if request is None:
            return False
        self.request = request
        self.echoes = 0
        full = detokenize(self.emitted)
        self.pending_text = full[len(self.sent_text) :] if full.startswith(self.sent_text) else ""
        return True
