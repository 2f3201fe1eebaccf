"""Workloads of ``pdserve bench serve``: seeded synthetic request lists and Mooncake trace
replay and generation.

Every workload is a tuple of :class:`Request` in send order. A request with ``after=None`` is
sent ``t_s`` seconds after the benchmark starts (open loop); a request with ``after=i`` is sent
``t_s`` seconds after request ``i`` finished (closed loop, used for multi-round
conversations). Prompts are token ids drawn uniformly from ``[TOKEN_LOW, vocab_size)``, which
keeps clear of the special tokens at the bottom of common vocabularies.

Mooncake traces are JSONL rows ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``; each hash id stands for one 512-token block and equal ids mean equal
content (ids are prefix-chained: the same id always sits behind the same prefix).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Lowest token id a workload uses (ids below are often special tokens).
TOKEN_LOW = 100
#: The default vocabulary size (SmolLM2's).
DEFAULT_VOCAB = 49152
#: Tokens per hash block in a Mooncake trace.
TRACE_BLOCK = 512
#: Seed component of the tokens of trace rows without hash ids (never a block id's seed).
_NO_BLOCKS = 2**40


@dataclass(frozen=True)
class Request:
    """One request of a workload (see the module docstring for ``t_s`` and ``after``)."""

    t_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    after: int | None = None


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    if vocab <= TOKEN_LOW:
        raise ValueError(f"vocab size {vocab} must exceed {TOKEN_LOW}")
    return tuple(int(t) for t in rng.integers(TOKEN_LOW, vocab, size=n))


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """``n`` arrival offsets (s): the first at 0, then exponential gaps of mean ``1/rate``;
    all at 0 when ``rate`` is infinite or not positive."""
    if n <= 0:
        return []
    if not math.isfinite(rate) or rate <= 0:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]


def _ratio_range(center: int, ratio: float) -> tuple[int, int]:
    """vLLM's random dataset range: ``[center*(1-ratio), center*(1+ratio)]``, at least 1."""
    if not 0 <= ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    return max(1, math.floor(center * (1 - ratio))), max(1, math.ceil(center * (1 + ratio)))


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    request_rate: float = math.inf,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> tuple[Request, ...]:
    """``num_prompts`` random prompts; input and output lengths uniform in
    ``[len*(1-range_ratio), len*(1+range_ratio)]``; Poisson arrivals at ``request_rate``."""
    rng = np.random.default_rng(seed)
    ilo, ihi = _ratio_range(input_len, range_ratio)
    olo, ohi = _ratio_range(output_len, range_ratio)
    in_lens = rng.integers(ilo, ihi + 1, size=num_prompts)
    out_lens = rng.integers(olo, ohi + 1, size=num_prompts)
    times = poisson_arrivals(rng, num_prompts, request_rate)
    return tuple(
        Request(times[i], _tokens(rng, int(in_lens[i]), vocab_size), int(out_lens[i]))
        for i in range(num_prompts)
    )


def prefix_repetition_workload(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    request_rate: float = math.inf,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> tuple[Request, ...]:
    """Each request is one of ``num_prefixes`` shared prefixes (used in turn, then shuffled)
    plus its own random suffix."""
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be at least 1")
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    order = rng.permutation(np.arange(num_prompts) % num_prefixes)
    times = poisson_arrivals(rng, num_prompts, request_rate)
    return tuple(
        Request(times[i], prefixes[int(p)] + _tokens(rng, suffix_len, vocab_size), output_len)
        for i, p in enumerate(order)
    )


def multi_round_workload(
    num_conversations: int,
    rounds: int,
    turn_len: int,
    output_len: int,
    request_rate: float = math.inf,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> tuple[Request, ...]:
    """Conversations of ``rounds`` rounds. Round ``r``'s prompt is the whole history (every
    earlier prompt turn and an ``output_len``-token stand-in answer per earlier round) plus a
    new ``turn_len``-token user turn. Round 0 of each conversation arrives by Poisson at
    ``request_rate``; round ``r > 0`` is sent as soon as round ``r - 1`` finished. Requests
    are listed conversation by conversation."""
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(rng, num_conversations, request_rate)
    out: list[Request] = []
    for c in range(num_conversations):
        history: tuple[int, ...] = ()
        for r in range(rounds):
            prompt = history + _tokens(rng, turn_len, vocab_size)
            after = None if r == 0 else len(out) - 1
            out.append(Request(starts[c] if r == 0 else 0.0, prompt, output_len, after))
            history = prompt + _tokens(rng, output_len, vocab_size)
    return tuple(out)


def long_prefill_workload(
    num_prompts: int,
    long_fraction: float,
    long_len: tuple[int, int],
    long_output_len: int,
    stream_len: int,
    stream_output_len: int,
    request_rate: float = math.inf,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> tuple[Request, ...]:
    """Long prompts arriving while many streams decode: Poisson arrivals at ``request_rate``,
    ``round(num_prompts * long_fraction)`` of them (placed at random) long prompts of a length
    uniform in ``long_len`` (inclusive) with ``long_output_len`` tokens out, the rest decode
    streams of ``stream_len`` prompt tokens and ``stream_output_len`` out. Where a prefill
    pool should pay: on a colocated engine each long prefill stalls the streams beside it."""
    lo, hi = long_len
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long fraction must be in [0, 1], got {long_fraction}")
    if not 1 <= lo <= hi:
        raise ValueError(f"long prompt lengths must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = np.random.default_rng(seed)
    n_long = round(num_prompts * long_fraction)
    is_long = rng.permutation(np.arange(num_prompts) < n_long)
    times = poisson_arrivals(rng, num_prompts, request_rate)
    out = []
    for i in range(num_prompts):
        if is_long[i]:
            n_in, n_out = int(rng.integers(lo, hi + 1)), long_output_len
        else:
            n_in, n_out = stream_len, stream_output_len
        out.append(Request(times[i], _tokens(rng, n_in, vocab_size), n_out))
    return tuple(out)


# --- Mooncake traces ------------------------------------------------------------------------


def read_trace(path: str | Path, max_rows: int = 0) -> list[TraceRow]:
    """Rows of a Mooncake JSONL trace (blank lines skipped), at most ``max_rows`` (0 = all).

    Raises:
        ValueError: a row that is not valid JSON or misses a field, with its line number.
    """
    rows: list[TraceRow] = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(
                    TraceRow(
                        float(d["timestamp"]),
                        int(d["input_length"]),
                        int(d["output_length"]),
                        tuple(int(h) for h in d.get("hash_ids", [])),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row: {exc}") from None
            if max_rows and len(rows) >= max_rows:
                break
    return rows


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> None:
    with Path(path).open("w") as f:
        for r in rows:
            row = {
                "timestamp": int(r.timestamp_ms),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")


def reuse_fraction(rows: Sequence[TraceRow]) -> float:
    """Share of all blocks (hash ids over all rows) whose id appeared in an earlier row."""
    seen: set[int] = set()
    total = repeated = 0
    for row in rows:
        total += len(row.hash_ids)
        repeated += sum(1 for h in row.hash_ids if h in seen)
        seen.update(row.hash_ids)
    return repeated / total if total else 0.0


def block_tokens(seed: int, hash_id: int, n: int, vocab_size: int) -> tuple[int, ...]:
    """The content of block ``hash_id``: ``n`` tokens drawn from a generator seeded by
    ``(seed, hash_id)``, so equal ids give equal tokens in any run."""
    return _tokens(np.random.default_rng([seed, hash_id]), n, vocab_size)


def scaled_prompt_len(input_length: int, num_blocks: int, block: int) -> int:
    """``round(input_length * block / 512)``, clamped so that each of ``num_blocks`` ids gets
    at least one token and none more than ``block`` (the last block is the partial one). With
    no blocks: at least 1."""
    n = round(input_length * block / TRACE_BLOCK)
    if num_blocks == 0:
        return max(1, n)
    return min(num_blocks * block, max((num_blocks - 1) * block + 1, n))


def trace_prompt(
    row: TraceRow,
    index: int,
    block: int,
    seed: int,
    vocab_size: int,
    cache: dict[int, tuple[int, ...]],
) -> tuple[int, ...]:
    """The prompt of row number ``index``: its blocks' contents (``block`` tokens each) cut
    to :func:`scaled_prompt_len`; a row without hash ids gets row-unique random tokens."""
    n = scaled_prompt_len(row.input_length, len(row.hash_ids), block)
    if not row.hash_ids:
        return _tokens(np.random.default_rng([seed, _NO_BLOCKS, index]), n, vocab_size)
    tokens: list[int] = []
    for h in row.hash_ids:
        if h not in cache:
            cache[h] = block_tokens(seed, h, block, vocab_size)
        tokens.extend(cache[h])
    return tuple(tokens[:n])


def trace_workload(
    rows: Sequence[TraceRow],
    block: int = 16,
    time_scale: float = 1.0,
    output_scale: float | None = None,
    min_output: int = 1,
    max_output: int = 0,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
) -> tuple[Request, ...]:
    """Replays trace rows: arrival ``(timestamp - first timestamp) / 1000 * time_scale``
    seconds, prompt from :func:`trace_prompt`, ``max_tokens = round(output_length *
    output_scale)`` clamped to ``[min_output, max_output]`` (``max_output`` 0 = no upper
    bound; ``output_scale`` None = ``block / 512``, the input's scaling)."""
    if block < 1:
        raise ValueError("block tokens must be at least 1")
    scale = block / TRACE_BLOCK if output_scale is None else output_scale
    t0 = min((r.timestamp_ms for r in rows), default=0.0)
    cache: dict[int, tuple[int, ...]] = {}
    out = []
    for i, row in enumerate(sorted(rows, key=lambda r: r.timestamp_ms)):
        m = max(min_output, round(row.output_length * scale))
        if max_output:
            m = min(m, max_output)
        t = (row.timestamp_ms - t0) / 1000.0 * time_scale
        out.append(Request(t, trace_prompt(row, i, block, seed, vocab_size, cache), max(1, m)))
    return tuple(out)


# --- trace generator ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceGenConfig:
    """Parameters of :func:`generate_trace` (lengths in 512-token blocks / original tokens).

    Each row is either a new session (probability ``1 - follow_up``): system block 0 plus
    ``first_blocks`` new blocks; or the next turn of a random earlier session that has turns
    left: that session's previous prompt blocks plus ``turn_blocks`` new ones (the answer and
    the new user message). Sessions end after ``max_turns`` turns. ``input_length`` leaves the
    last block partial (uniform 1..512 tokens in it); ``output_length`` is uniform in
    ``output_tokens``. Arrivals are Poisson at ``rate`` rows/s, then floored to a multiple
    of ``arrival_step_ms`` when it is positive: the Mooncake conversation trace logs its
    arrivals in 3,000 ms steps, so its requests come in bursts that land together.
    """

    rows: int = 500
    rate: float = 1.0
    seed: int = 0
    first_blocks: tuple[int, int] = (10, 16)
    turn_blocks: tuple[int, int] = (1, 4)
    follow_up: float = 0.1
    max_turns: int = 4
    output_tokens: tuple[int, int] = (64, 512)
    arrival_step_ms: float = 0.0


#: Presets of ``--reuse``: with 16-token blocks, ``light`` gives a mean input near 220 tokens
#: with about 17% of blocks repeated; ``heavy`` about 300 tokens and 45%.
REUSE_PRESETS: dict[str, dict[str, Any]] = {
    "light": {},
    "heavy": {"first_blocks": (13, 19), "turn_blocks": (2, 5), "follow_up": 0.45, "max_turns": 3},
}


def generate_trace(cfg: TraceGenConfig) -> list[TraceRow]:
    """A conversation-like Mooncake trace (see :class:`TraceGenConfig`), deterministic by
    ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    times = poisson_arrivals(rng, cfg.rows, cfg.rate)
    if cfg.arrival_step_ms > 0:
        step = cfg.arrival_step_ms / 1000.0
        times = [math.floor(t / step) * step for t in times]
    next_id = 1
    sessions: list[tuple[list[int], int]] = []  # (prompt blocks, turns so far)
    open_sessions: list[int] = []
    rows: list[TraceRow] = []

    def new_blocks(lo_hi: tuple[int, int]) -> list[int]:
        nonlocal next_id
        n = int(rng.integers(lo_hi[0], lo_hi[1] + 1))
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    for t in times:
        if open_sessions and rng.random() < cfg.follow_up:
            k = open_sessions[int(rng.integers(len(open_sessions)))]
            prev, turns = sessions[k]
            blocks = prev + new_blocks(cfg.turn_blocks)
            sessions[k] = (blocks, turns + 1)
            if turns + 1 >= cfg.max_turns:
                open_sessions.remove(k)
        else:
            blocks = [0, *new_blocks(cfg.first_blocks)]
            sessions.append((blocks, 1))
            if cfg.max_turns > 1:
                open_sessions.append(len(sessions) - 1)
        input_length = (len(blocks) - 1) * TRACE_BLOCK + int(rng.integers(1, TRACE_BLOCK + 1))
        output_length = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        rows.append(TraceRow(round(t * 1000.0), input_length, output_length, tuple(blocks)))
    return rows


@dataclass(frozen=True)
class WorkloadStats:
    requests: int
    mean_input: float
    mean_output: float
    min_output: int
    max_output: int
    span_s: float


def workload_stats(requests: Sequence[Request]) -> WorkloadStats:
    """Sizes of a workload (span: last open-loop arrival offset)."""
    if not requests:
        return WorkloadStats(0, 0.0, 0.0, 0, 0, 0.0)
    outs = [r.max_tokens for r in requests]
    return WorkloadStats(
        requests=len(requests),
        mean_input=float(np.mean([len(r.prompt_token_ids) for r in requests])),
        mean_output=float(np.mean(outs)),
        min_output=min(outs),
        max_output=max(outs),
        span_s=max((r.t_s for r in requests if r.after is None), default=0.0),
    )
