"""Build: the requests the router sends its workers (engine.proto), from a :class:`GenRequest`.
Pure functions; the sampling controls go through :mod:`pdserve.requests_codec`."""

from __future__ import annotations

from pdserve.hashing import ModelFingerprint
from pdserve.requests_codec import sampling_to_proto
from pdserve.services.router.request import GenRequest
from pdserve.v1 import common_pb2, engine_pb2


def prefill_request(req: GenRequest, model: str, *, publish: bool) -> engine_pb2.PrefillRequest:
    """Prefill of ``req``'s prompt; ``publish``: chunk by chunk as computed (the write plan)."""
    return engine_pb2.PrefillRequest(
        request_id=req.request_id,
        model=model,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling_to_proto(req.sampling),
        publish_incrementally=publish,
        cache_salt=req.cache_salt,
        tenant=req.tenant,
        priority=req.priority,
    )


def decode_request(req: GenRequest, model: str, **fields) -> engine_pb2.DecodeRequest:
    """Decode of ``req``; ``fields`` are the plan's: ``kv`` and ``first_token_id`` (read),
    ``kv`` and ``chunk_wait_ms`` (write), none (local: the worker prefills)."""
    return engine_pb2.DecodeRequest(
        request_id=req.request_id,
        model=model,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling_to_proto(req.sampling),
        cache_salt=req.cache_salt,
        tenant=req.tenant,
        priority=req.priority,
        **fields,
    )


def write_handle(keys: list[str], prompt_tokens: int, fp: ModelFingerprint) -> common_pb2.KVHandle:
    """The write plan's handle: the keys of the prompt's first ``(n - 1) // chunk_size`` full
    chunks, which the parallel prefill publishes (the last prompt token stays to compute)."""
    cs = fp.chunk_size
    k = (prompt_tokens - 1) // cs
    return common_pb2.KVHandle(
        chunk_keys=keys[:k], num_tokens=k * cs, chunk_size=cs, fingerprint=fp.digest()
    )


def resumed_request(
    first: engine_pb2.DecodeRequest, emitted: list[int]
) -> engine_pb2.DecodeRequest | None:
    """The Decode that continues ``first`` after the tokens already streamed, ``emitted``: its
    worker prefills prompt + emitted (reusing stored chunks) and generates the tokens left,
    so greedy output is unchanged. None when it cannot (no max_tokens, or nothing left)."""
    left = first.sampling.max_tokens - len(emitted)
    if first.sampling.max_tokens == 0 or left <= 0 or not emitted:
        return None
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(first.sampling)
    sampling.max_tokens = left
    return engine_pb2.DecodeRequest(
        request_id=first.request_id,
        model=first.model,
        prompt_token_ids=[*first.prompt_token_ids, *emitted],
        sampling=sampling,
        cache_salt=first.cache_salt,
        tenant=first.tenant,
        priority=first.priority,
    )
