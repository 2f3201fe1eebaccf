"""Token logprobs between the engines' :class:`TokenLogprob` and common.proto's
``OutputLogProbs`` (workers send them, the router reads and re-sends them)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engines.base import TokenLogprob
from pdserve.v1 import common_pb2


def to_proto(items: Sequence[TokenLogprob]) -> common_pb2.OutputLogProbs:
    return common_pb2.OutputLogProbs(
        token_logprobs=[x.logprob for x in items],
        token_ids=[x.token_id for x in items],
        top_logprobs=[
            common_pb2.TopLogProbs(values=[v for _, v in x.top], token_ids=[t for t, _ in x.top])
            for x in items
        ],
    )


def from_proto(p: common_pb2.OutputLogProbs) -> list[TokenLogprob]:
    """The inverse of :func:`to_proto`."""
    tops = list(p.top_logprobs)
    return [
        TokenLogprob(
            int(t),
            float(v),
            tuple(zip(tops[i].token_ids, tops[i].values, strict=True)) if i < len(tops) else (),
        )
        for i, (t, v) in enumerate(zip(p.token_ids, p.token_logprobs, strict=True))
    ]
