"""Generated conversation traces in the Mooncake trace's shape (:func:`generate_trace`) and
``pdserve bench serve gen-trace``, which writes one for ``--workload trace``. Imports only the
standard library until it runs (the command line is built from it)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.bench.serve.workloads import TraceRow

#: Tokens per hash block in a Mooncake trace (``workloads.TRACE_BLOCK``).
TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceGenConfig:
    """Parameters of :func:`generate_trace` (lengths in 512-token blocks / original tokens).

    Each row is either a new session (probability ``1 - follow_up``): system block 0 plus
    ``first_blocks`` new blocks; or the next turn of a random earlier session that has turns
    left: that session's previous prompt blocks plus ``turn_blocks`` new ones (the answer and
    the new user message). Sessions end after ``max_turns`` turns and, when ``session_rows``
    is positive, once ``session_rows`` rows have arrived since their first turn (a session
    lives that long, its turns spread over it: with a high ``follow_up`` a trace's later rows
    mostly continue sessions begun in its earlier rows). ``input_length`` leaves the last
    block partial (uniform 1..512 tokens in it); ``output_length`` is uniform in
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
    session_rows: int = 0


#: Presets of ``--reuse``: with 16-token blocks, ``light`` gives a mean input near 220 tokens
#: with about 17% of blocks repeated; ``heavy`` about 300 tokens and 45%; ``sessions``
#: long-lived conversations (turns spread over 1,000 rows), mean input near 215 tokens: the
#: ideal reuse of rows 1,000-1,500 is about 59% given the rows before them, 32% without.
REUSE_PRESETS: dict[str, dict[str, Any]] = {
    "light": {},
    "heavy": {"first_blocks": (13, 19), "turn_blocks": (2, 5), "follow_up": 0.45, "max_turns": 3},
    "sessions": {
        "first_blocks": (8, 12),
        "turn_blocks": (1, 3),
        "follow_up": 0.6,
        "max_turns": 40,
        "session_rows": 1000,
    },
}


def generate_trace(cfg: TraceGenConfig) -> list[TraceRow]:
    """A conversation-like Mooncake trace (see :class:`TraceGenConfig`), deterministic by
    ``cfg.seed``."""
    import numpy as np

    from pdserve.bench.serve.workloads import TraceRow, poisson_arrivals

    rng = np.random.default_rng(cfg.seed)
    times = poisson_arrivals(rng, cfg.rows, cfg.rate)
    if cfg.arrival_step_ms > 0:
        step = cfg.arrival_step_ms / 1000.0
        times = [math.floor(t / step) * step for t in times]
    next_id = 1
    sessions: list[tuple[list[int], int]] = []  # (prompt blocks, turns so far)
    started: list[int] = []  # each session's first row
    open_sessions: list[int] = []
    rows: list[TraceRow] = []

    def new_blocks(lo_hi: tuple[int, int]) -> list[int]:
        nonlocal next_id
        n = int(rng.integers(lo_hi[0], lo_hi[1] + 1))
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    for i, t in enumerate(times):
        if cfg.session_rows > 0:
            open_sessions = [k for k in open_sessions if i - started[k] < cfg.session_rows]
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
            started.append(i)
            if cfg.max_turns > 1:
                open_sessions.append(len(sessions) - 1)
        input_length = (len(blocks) - 1) * TRACE_BLOCK + int(rng.integers(1, TRACE_BLOCK + 1))
        output_length = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        rows.append(TraceRow(round(t * 1000.0), input_length, output_length, tuple(blocks)))
    return rows


# --- pdserve bench serve gen-trace ----------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive (or inf)")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _pair(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI") from None
    if pair[0] < 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LO <= HI")
    return pair


def add_gen_trace_command(parser: argparse.ArgumentParser) -> None:
    """The ``gen-trace`` subcommand of ``pdserve bench serve``."""
    sub = parser.add_subparsers(dest="serve_command", metavar="{gen-trace}")
    gen = sub.add_parser(
        "gen-trace",
        help="write a conversation-like Mooncake trace (JSONL) for --workload trace",
        description=(
            "Writes a Mooncake JSONL trace: rows {timestamp ms, input_length, output_length, "
            "hash_ids} at Poisson arrivals, floored to --arrival-step-ms. Every row starts "
            "with the shared system block 0; a row is a new session (system block + new "
            "blocks) or the next turn of an earlier session (its previous blocks + new ones). "
            "Prints the reuse fraction (share of "
            "blocks whose id appeared in an earlier row) and the replayed sizes. With "
            "--block-tokens 16, '--reuse light' gives a mean input near 220 tokens, output "
            "2-16, about 17% reused blocks; '--reuse heavy' about 300 tokens and 45%; "
            "'--reuse sessions' long-lived sessions (up to 40 turns each, spread over "
            "--session-rows 1000 rows; --follow-up 0.6), mean input near 215 tokens, so that "
            "a window's reuse depends on the rows before it: of 1,500 rows, the last 500 "
            "could reuse about 59% of their prompt given the first 1,000 as history "
            "(bench serve --history-rows 1000), 32% without. --history-rows N prints that "
            "ideal reuse for the trace written."
        ),
    )
    add_gen_trace_arguments(gen)


def add_gen_trace_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    p.add_argument("--rows", type=int, default=500, help=f"requests {d}")
    p.add_argument("--rate", type=_rate, default=1.0, help=f"Poisson arrivals per second {d}")
    p.add_argument("--seed", type=int, default=0, help=f"seed {d}")
    p.add_argument(
        "--arrival-step-ms",
        type=_non_negative,
        default=3000.0,
        help="floor each arrival to a multiple of this, so requests come in bursts as in the "
        f"Mooncake conversation trace, which logs arrivals in 3,000 ms steps (0 = Poisson) {d}",
    )
    p.add_argument(
        "--reuse",
        choices=list(REUSE_PRESETS),
        default="light",
        help=f"parameter preset {d}",
    )
    p.add_argument(
        "--first-blocks",
        type=_pair,
        metavar="LO:HI",
        help="new blocks of a session's first turn (default: preset)",
    )
    p.add_argument(
        "--turn-blocks",
        type=_pair,
        metavar="LO:HI",
        help="new blocks of a later turn (default: preset)",
    )
    p.add_argument(
        "--follow-up", type=float, help="probability a row continues a session (default: preset)"
    )
    p.add_argument("--max-turns", type=int, help="turns per session (default: preset)")
    p.add_argument(
        "--session-rows",
        type=int,
        metavar="N",
        help="a session ends N rows after its first turn, its turns spread over them (0 = "
        "only --max-turns ends it) (default: preset: 1000 for sessions, else 0)",
    )
    p.add_argument("--output-tokens", type=_pair, metavar="LO:HI", help="output_length range in trace tokens (default: 64:512, i.e. 2-16 at --block-tokens 16)")  # fmt: skip
    p.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help=f"block size for the printed replay sizes only {d}",
    )
    p.add_argument(
        "--history-rows",
        type=int,
        default=0,
        metavar="N",
        help="also print the ideal prefix reuse of the rows after the first N, given those N "
        f"as history and without them (as bench serve --history-rows N reports it) {d}",
    )
    p.set_defaults(func=gen_trace_cli)


PRESET_FIELDS = (
    "first_blocks",
    "turn_blocks",
    "follow_up",
    "max_turns",
    "output_tokens",
    "session_rows",
)


def gen_trace_cli(args: argparse.Namespace) -> int:
    from pdserve.bench.serve import workloads as wl

    kw: dict[str, Any] = dict(REUSE_PRESETS[args.reuse])
    for name in PRESET_FIELDS:
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    cfg = TraceGenConfig(
        rows=args.rows,
        rate=args.rate,
        seed=args.seed,
        arrival_step_ms=args.arrival_step_ms,
        **kw,
    )
    rows = generate_trace(cfg)
    wl.write_trace(args.out, rows)
    stats = wl.workload_stats(wl.trace_workload(rows, block=args.block_tokens))
    print(
        f"wrote {len(rows)} rows to {args.out}: span {stats.span_s:.1f} s, reuse fraction "
        f"{wl.reuse_fraction(rows):.3f}; replayed at --block-tokens {args.block_tokens}: mean "
        f"input {stats.mean_input:.1f} tokens, output {stats.min_output}-{stats.max_output} "
        f"(mean {stats.mean_output:.1f})"
    )
    n = getattr(args, "history_rows", 0)
    if 0 < n < len(rows):
        given = wl.ideal_prefix_reuse(rows, n, args.block_tokens)
        alone = wl.ideal_prefix_reuse(rows[n:], 0, args.block_tokens)
        print(
            f"ideal prefix reuse of rows {n + 1}-{len(rows)}: {given.token_fraction:.1%} of "
            f"their prompt tokens given the {n} rows before as history, "
            f"{alone.token_fraction:.1%} without (blocks: {given.fraction:.1%} / "
            f"{alone.fraction:.1%})"
        )
    return 0
