"""Workloads of ``pdserve bench serve``: determinism, trace scaling, block content identity,
multi-round history and the trace generator's reuse."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.serve import workloads as wl
from pdserve.bench.serve.gentrace import REUSE_PRESETS, TraceGenConfig, generate_trace
from pdserve.bench.serve.workloads import TraceRow


def test_random_is_deterministic_by_seed_and_in_range() -> None:
    a = wl.random_workload(20, 64, 8, 0.5, 4.0, seed=3, vocab_size=512)
    assert a == wl.random_workload(20, 64, 8, 0.5, 4.0, seed=3, vocab_size=512)
    assert a != wl.random_workload(20, 64, 8, 0.5, 4.0, seed=4, vocab_size=512)
    assert all(32 <= len(r.prompt_token_ids) <= 96 and 4 <= r.max_tokens <= 12 for r in a)
    assert all(wl.TOKEN_LOW <= t < 512 for r in a for t in r.prompt_token_ids)
    times = [r.t_s for r in a]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0
    assert all(r.after is None for r in a)


def test_random_infinite_rate_sends_at_once() -> None:
    reqs = wl.random_workload(5, 16, 4, request_rate=math.inf)
    assert [r.t_s for r in reqs] == [0.0] * 5
    assert {len(r.prompt_token_ids) for r in reqs} == {16}


def test_poisson_rate_is_about_right() -> None:
    times = wl.poisson_arrivals(np.random.default_rng(0), 4001, 10.0)
    assert times[-1] / 4000 == pytest.approx(0.1, rel=0.05)


def test_prefix_repetition_shares_prefixes() -> None:
    reqs = wl.prefix_repetition_workload(12, 3, 20, 5, 4, seed=1)
    assert reqs == wl.prefix_repetition_workload(12, 3, 20, 5, 4, seed=1)
    prefixes = {r.prompt_token_ids[:20] for r in reqs}
    assert len(prefixes) == 3
    assert all(len(r.prompt_token_ids) == 25 and r.max_tokens == 4 for r in reqs)
    counts = [sum(r.prompt_token_ids[:20] == p for r in reqs) for p in prefixes]
    assert sorted(counts) == [4, 4, 4]


def test_multi_round_history_grows() -> None:
    reqs = wl.multi_round_workload(3, 4, turn_len=10, output_len=5, request_rate=2.0, seed=2)
    assert reqs == wl.multi_round_workload(3, 4, 10, 5, 2.0, seed=2)
    assert len(reqs) == 12
    for c in range(3):
        conv = reqs[4 * c : 4 * c + 4]
        assert conv[0].after is None
        for r in range(1, 4):
            prev, cur = conv[r - 1], conv[r]
            assert cur.after == 4 * c + r - 1  # sent after the previous round finished
            assert cur.t_s == 0.0
            # history = previous prompt + a 5-token answer, then a new 10-token turn
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert len(cur.prompt_token_ids) == len(prev.prompt_token_ids) + 5 + 10
        assert [len(r.prompt_token_ids) for r in conv] == [10, 25, 40, 55]
    starts = [reqs[4 * c].t_s for c in range(3)]
    assert starts[0] == 0.0 and starts == sorted(starts)


@pytest.mark.parametrize(
    ("input_length", "blocks", "block", "expected"),
    [
        (1024, 2, 16, 32),  # exact: 2 full blocks
        (700, 2, 16, 22),  # round(700 * 16 / 512) = round(21.875)
        (513, 2, 16, 17),  # round(16.03) = 16 would leave the second id empty: >= 1 token
        (5000, 2, 16, 32),  # longer than its blocks: capped at 2 blocks
        (300, 0, 16, 9),  # no hash ids: just the scaled length
        (10, 0, 16, 1),  # at least one token
        (512, 1, 512, 512),  # unscaled
    ],
)
def test_trace_scaling_arithmetic(
    input_length: int, blocks: int, block: int, expected: int
) -> None:
    assert wl.scaled_prompt_len(input_length, blocks, block) == expected


def test_equal_hash_ids_give_equal_tokens() -> None:
    rows = [
        TraceRow(0, 1024, 100, (0, 1)),
        TraceRow(1000, 1300, 100, (0, 1, 2)),
        TraceRow(2500, 600, 100, (0, 7)),
        TraceRow(3000, 1400, 100, (5, 6, 8)),
    ]
    reqs = wl.trace_workload(rows, block=16, seed=9, vocab_size=1000)
    p = [r.prompt_token_ids for r in reqs]
    assert [len(x) for x in p] == [32, 41, 19, 44]  # round(n * 16 / 512)
    assert p[1][:32] == p[0]  # blocks 0, 1 shared
    assert p[2][:16] == p[0][:16] and p[2][16:] != p[0][16:19]  # block 0 only
    assert p[3][:16] != p[0][:16]
    assert p[0][:16] == wl.block_tokens(9, 0, 16, 1000)
    # same seed, same content in any run; another seed, another content
    assert wl.trace_workload(rows, block=16, seed=9, vocab_size=1000) == reqs
    assert wl.trace_workload(rows, block=16, seed=10, vocab_size=1000)[0] != reqs[0]


def test_trace_times_and_outputs() -> None:
    rows = [TraceRow(5000, 512, 320, (1,)), TraceRow(6500, 512, 32, (2,))]
    reqs = wl.trace_workload(rows, block=16, time_scale=2.0)
    assert [r.t_s for r in reqs] == [0.0, 3.0]  # (6500 - 5000) ms * 2
    assert [r.max_tokens for r in reqs] == [10, 1]  # output scaled by 16/512 by default
    reqs = wl.trace_workload(rows, block=16, output_scale=0.1, min_output=4, max_output=16)
    assert [r.max_tokens for r in reqs] == [16, 4]


def test_trace_file_round_trip(tmp_path: Path) -> None:
    rows = generate_trace(TraceGenConfig(rows=50, seed=1))
    path = tmp_path / "t.jsonl"
    wl.write_trace(path, rows)
    assert wl.read_trace(path) == rows
    assert wl.read_trace(path, max_rows=7) == rows[:7]
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        wl.read_trace(path)


def test_reuse_fraction() -> None:
    rows = [TraceRow(0, 1, 1, (0, 1)), TraceRow(1, 1, 1, (0, 1, 2)), TraceRow(2, 1, 1, (0, 3))]
    assert wl.reuse_fraction(rows) == pytest.approx(3 / 7)
    assert wl.reuse_fraction([]) == 0.0


@pytest.mark.parametrize(
    ("preset", "reuse", "mean_input"),
    [("light", (0.13, 0.21), (205, 235)), ("heavy", (0.40, 0.50), (280, 320))],
)
def test_generator_presets(
    preset: str, reuse: tuple[float, float], mean_input: tuple[float, float]
) -> None:
    cfg = TraceGenConfig(rows=1000, seed=0, **REUSE_PRESETS[preset])
    rows = generate_trace(cfg)
    assert rows == generate_trace(cfg)
    assert reuse[0] <= wl.reuse_fraction(rows) <= reuse[1]
    assert all(r.hash_ids[0] == 0 for r in rows)  # the shared system block
    stats = wl.workload_stats(wl.trace_workload(rows, block=16))
    assert mean_input[0] <= stats.mean_input <= mean_input[1]
    assert (stats.min_output, stats.max_output) == (2, 16)
    assert stats.span_s == pytest.approx(1000 / cfg.rate, rel=0.1)
    for r in rows:  # the last block is the partial one
        assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512


def test_generator_sessions_repeat_earlier_turns() -> None:
    rows = generate_trace(TraceGenConfig(rows=200, seed=5, follow_up=0.5))
    follow_ups = 0
    for i, row in enumerate(rows):
        earlier = [r.hash_ids for r in rows[:i] if len(r.hash_ids) < len(row.hash_ids)]
        if any(row.hash_ids[: len(e)] == e and len(e) > 1 for e in earlier):
            follow_ups += 1
    assert follow_ups > 50


def test_generator_arrival_steps_make_bursts() -> None:
    poisson = generate_trace(TraceGenConfig(rows=300, rate=3.0, seed=2))
    steps = generate_trace(TraceGenConfig(rows=300, rate=3.0, seed=2, arrival_step_ms=3000))
    # the same rows, each arrival floored to its 3 s step: bursts of about 9 at once
    assert [r.timestamp_ms // 3000 * 3000 for r in poisson] == [r.timestamp_ms for r in steps]
    assert [r.hash_ids for r in poisson] == [r.hash_ids for r in steps]
    bursts = {r.timestamp_ms for r in steps}
    assert len(steps) / len(bursts) == pytest.approx(9.0, rel=0.2)


def test_long_prefill_mixes_long_prompts_into_decode_streams() -> None:
    reqs = wl.long_prefill_workload(40, 0.25, (100, 300), 4, 16, 64, request_rate=2.0, seed=3)
    assert reqs == wl.long_prefill_workload(40, 0.25, (100, 300), 4, 16, 64, 2.0, seed=3)
    long = [r for r in reqs if r.max_tokens == 4]
    streams = [r for r in reqs if r.max_tokens == 64]
    assert (len(long), len(streams)) == (10, 30)
    assert all(100 <= len(r.prompt_token_ids) <= 300 for r in long)
    assert len({len(r.prompt_token_ids) for r in long}) > 1  # lengths drawn, not fixed
    assert {len(r.prompt_token_ids) for r in streams} == {16}
    assert [r.t_s for r in reqs] == sorted(r.t_s for r in reqs)
    assert [i for i, r in enumerate(reqs) if r.max_tokens == 4] != list(range(10))  # shuffled
    with pytest.raises(ValueError, match="long fraction"):
        wl.long_prefill_workload(4, 1.5, (1, 2), 1, 1, 1)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        wl.long_prefill_workload(4, 0.5, (5, 2), 1, 1, 1)
