"""The shared request types (:mod:`pdserve.requests`) to and from their common.proto forms,
both directions side by side: the router encodes, the workers decode, and the round trip is
the identity (tests/test_requests_codec.py).

- :class:`Sampling` <-> ``SamplingParams``: defaults are left unset on the wire (temperature
  and top_p are always sent); ``max_tokens`` 0 on the wire means the receiver's default.
- :class:`TokenLogprob` lists <-> ``OutputLogProbs``.
- :class:`KVRef` <-> ``KVHandle``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.requests import KVRef, Sampling, TokenLogprob
from pdserve.v1 import common_pb2


def sampling_to_proto(s: Sampling) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.presence_penalty:
        p.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        p.frequency_penalty = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        p.repetition_penalty = s.repetition_penalty
    for token, bias in s.logit_bias:
        p.logit_bias[token] = bias
    p.stop_token_ids.extend(s.stop_token_ids)
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    p.json_object = s.json_object
    p.json_schema = s.json_schema
    p.min_tokens = s.min_tokens
    if not s.skip_special_tokens:
        p.skip_special_tokens = False
    return p


def sampling_from_proto(p: common_pb2.SamplingParams, *, default_max_tokens: int) -> Sampling:
    """The inverse of :func:`sampling_to_proto`, applying the documented defaults of unset
    fields; ``max_tokens`` 0 becomes ``default_max_tokens``. Not validated: the receiver
    validates the result (INVALID_ARGUMENT naming the field)."""
    return Sampling(
        max_tokens=p.max_tokens or default_max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        json_object=p.json_object,
        json_schema=p.json_schema,
        min_tokens=p.min_tokens,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
    )


def logprobs_to_proto(items: Sequence[TokenLogprob]) -> common_pb2.OutputLogProbs:
    return common_pb2.OutputLogProbs(
        token_logprobs=[x.logprob for x in items],
        token_ids=[x.token_id for x in items],
        top_logprobs=[
            common_pb2.TopLogProbs(values=[v for _, v in x.top], token_ids=[t for t, _ in x.top])
            for x in items
        ],
    )


def logprobs_from_proto(p: common_pb2.OutputLogProbs) -> list[TokenLogprob]:
    """The inverse of :func:`logprobs_to_proto`."""
    tops = list(p.top_logprobs)
    return [
        TokenLogprob(
            int(t),
            float(v),
            tuple(zip(tops[i].token_ids, tops[i].values, strict=True)) if i < len(tops) else (),
        )
        for i, (t, v) in enumerate(zip(p.token_ids, p.token_logprobs, strict=True))
    ]


def kvref_to_proto(kv: KVRef) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        chunk_keys=list(kv.chunk_keys),
        tail_key=kv.tail_key,
        num_tokens=kv.num_tokens,
        chunk_size=kv.chunk_size,
        fingerprint=kv.fingerprint,
    )


def kvref_from_proto(h: common_pb2.KVHandle) -> KVRef:
    """The inverse of :func:`kvref_to_proto`."""
    return KVRef(
        chunk_keys=tuple(h.chunk_keys),
        tail_key=h.tail_key,
        num_tokens=h.num_tokens,
        chunk_size=h.chunk_size,
        fingerprint=bytes(h.fingerprint),
    )
