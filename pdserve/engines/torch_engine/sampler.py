"""The torch engine's sampler: logit processing (bias, penalties), the token pick (greedy, or
temperature, top-k and top-p with a per-request seed) and logprobs, as vLLM's sampler does
them, so the two engines agree token for token where they can."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.errors import InvalidArgument
from pdserve.requests import Sampling, TokenLogprob


def process_logits(
    logits: torch.Tensor,
    sampling: Sampling,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> torch.Tensor:
    """``logits`` ([vocab]) after ``logit_bias`` and the penalties, in vLLM's order (its
    sampler: logit bias, then the repetition penalty over ``prompt`` and ``output`` tokens,
    then the frequency and presence penalties over the ``output`` tokens). Unchanged (the same
    tensor) when the sampling asks none."""
    if not sampling.penalized:
        return logits
    scores = logits.float().clone()
    vocab = scores.numel()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long)
        scores.index_add_(0, ids, torch.tensor([b for _, b in sampling.logit_bias]))
    if sampling.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], dtype=torch.long)] = True
        r = sampling.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
    if (sampling.frequency_penalty or sampling.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].float()
        scores = scores - sampling.frequency_penalty * counts
        scores = scores - sampling.presence_penalty * (counts > 0).float()
    return scores


def sample_token(
    logits: torch.Tensor,
    sampling: Sampling,
    seed: int,
    step: int,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos_token_id: int = -1,
) -> int:
    """Picks the next token from last-position ``logits`` ([vocab]).

    First :func:`process_logits` (logit bias and penalties, given the ``prompt`` and the
    ``output`` tokens so far); while ``output`` is shorter than ``min_tokens``, EOS and the stop
    token ids cannot be picked (vLLM's min-tokens processor); then greedy when temperature is
    0; otherwise temperature, top-k and top-p filtering, then a draw from a generator seeded by ``(seed, step)``, so a seeded
    request gives the same tokens whether or not its first token was sampled on another worker.
    """
    logits = process_logits(logits, sampling, prompt, output)
    if len(output) < sampling.min_tokens:
        held = [t for t in (eos_token_id, *sampling.stop_token_ids) if 0 <= t < logits.numel()]
        if held:
            logits = logits.float().clone()
            logits[torch.tensor(held, dtype=torch.long)] = float("-inf")
    if sampling.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > sampling.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log probability under the raw model distribution (log_softmax of the
    unprocessed ``logits``, vLLM's default ``logprobs_mode="raw_logprobs"``) and the ``top``
    most likely tokens, most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), best)


def refuse_constrained(sampling: Sampling) -> None:
    """INVALID_ARGUMENT for a request that asks for JSON output: this engine has no guided
    decoding."""
    if sampling.constrained:
        field = "json_schema" if sampling.json_schema else "json_object"
        raise InvalidArgument(
            f"response_format ({field}): the torch engine has no guided decoding (structured "
            "outputs); serve with the vllm engine for JSON output",
            param="response_format",
        )
