"""The scheduler's step budget: a learnt step-cost model and the prompt tokens a step may
take beside decoding streams without pushing any of them past its TPOT target."""

from __future__ import annotations

import pytest

from pdserve.engines.step_budget import (
    Prompt,
    StepCost,
    Stream,
    chunked_on_time,
    deadline_group,
    future_tokens,
    group_tokens,
    next_prompt,
    on_time_budget,
    prompt_budget,
    streams_overrun,
)

TARGET = 0.150  # seconds per output token


def test_cost_model_learns_fixed_and_per_token_cost():
    cost = StepCost(fixed_s=0.010, per_token_s=0.001)
    for _ in range(60):
        cost.observe(0.040, 0)  # decode-only steps take 40 ms
        cost.observe(0.040 + 64 * 0.002, 64)  # 2 ms per prompt token
    assert cost.fixed_s == pytest.approx(0.040, rel=0.01)
    assert cost.per_token_s == pytest.approx(0.002, rel=0.01)
    assert cost.tokens_within(0.040 + 0.2) in (99, 100)  # learnt, so within rounding
    assert cost.tokens_within(0.020) == 0  # less than the fixed cost: no prompt tokens
    cost.observe(0.5, 3)  # too few prompt tokens to say anything per token
    assert cost.per_token_s == pytest.approx(0.002, rel=0.01)


def test_expected_future_tokens():
    assert future_tokens(Stream(0.0, 1, 9)) == 4  # at least 4 more
    assert future_tokens(Stream(0.0, 6, 100)) == 6  # as many again as so far
    assert future_tokens(Stream(0.0, 6, 9)) == 2  # capped by max_tokens (after the next one)
    assert future_tokens(Stream(0.0, 9, 9)) == 0


def test_a_stream_about_to_end_allows_one_target_of_prefill():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    # one token so far and one to go: only this step to stay within target
    assert prompt_budget([Stream(10.0, 1, 2)], 10.0, TARGET, cost, 32) == 80  # (150-30)/1.5


def test_a_young_stream_absorbs_a_long_step_over_its_future_tokens():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    # 1 token, 4 expected after the next: 150 * 5 - 0 - 4 * 30 = 630 ms -> (630 - 30) / 1.5
    assert prompt_budget([Stream(10.0, 1, 16)], 10.0, TARGET, cost, 32) == 400


def test_the_stream_with_least_slack_decides_and_progress_is_guaranteed():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    ahead = Stream(10.0, 5, 6)  # 5 tokens in 0.5 s, ends after the next
    behind = Stream(10.0, 2, 3)  # 2 tokens in 0.5 s: over target, ends after the next
    assert prompt_budget([ahead, behind], 10.5, TARGET, cost, 32) == 32
    assert prompt_budget([ahead], 10.5, TARGET, cost, 32) == 146  # (750 - 500 - 30) / 1.5
    # prompts that may wait (late ones): no floor, the stream behind gets a decode-only step
    assert prompt_budget([ahead, behind], 10.5, TARGET, cost, 0) == 0
    assert prompt_budget([ahead], 10.5, TARGET, cost, 0) == 146  # a budget is still used


def test_streams_overrun_counts_the_streams_a_step_takes_past_the_target():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    young = Stream(10.0, 1, 16)  # allows a 630 ms step
    ending = Stream(10.0, 1, 2)  # allows 150 ms
    streams = [young, ending]
    assert streams_overrun(streams, 10.0, TARGET, cost, 80) == 0  # 150 ms: both keep it
    assert streams_overrun(streams, 10.0, TARGET, cost, 81) == 1
    assert streams_overrun(streams, 10.0, TARGET, cost, 400) == 1  # 630 ms
    assert streams_overrun(streams, 10.0, TARGET, cost, 401) == 2
    assert streams_overrun([], 10.0, TARGET, cost, 10_000) == 0


def test_without_a_floor_the_planned_decode_only_steps_keep_the_target():
    """A young stream absorbs one long step, counting on decode-only steps after it. With a
    block forced into each of those (the floor), its TPOT goes past the target; with no floor
    (late prompts may wait) the budget after the long step is 0 and the TPOT is the target."""
    cost = StepCost(fixed_s=0.060, per_token_s=0.004)  # float32 on one AVX2 core
    fresh = Stream(0.0, 1, 6)  # first token at 0; 5 to go
    first = prompt_budget([fresh], 0.0, TARGET, cost, 0)
    assert first == 112  # 150 * 5 - 4 * 60 = 510 ms -> (510 - 60) / 4
    for floor, worst_ms in ((32, 270), (0, 150)):
        t, tokens = cost.step_s(first), 2
        while tokens < 6:
            t += cost.step_s(prompt_budget([Stream(0.0, tokens, 6)], t, TARGET, cost, floor))
            tokens += 1
        assert round(1000 * t / 5) <= worst_ms
        assert (round(1000 * t / 5) > 150) == (floor > 0)


def test_next_prompt_orders():
    now = 100.0
    prompts = [Prompt(99.0, 300), Prompt(99.5, 40), Prompt(99.2, 40), Prompt(98.0, 200)]
    assert next_prompt(prompts, now, 0.0, "shortest") == 2  # fewest tokens; tie: the oldest
    assert next_prompt(prompts, now, 0.0, "arrival") == 3  # the oldest
    # waiting 1.5 s or more is urgent: before any shorter prompt, the oldest urgent first
    assert next_prompt(prompts, now, 1.5, "shortest") == 3
    assert next_prompt(prompts, now, 3.0, "shortest") == 2  # nobody has waited 3 s
    assert next_prompt([Prompt(now, 10)], now, 1.5, "shortest") == 0


def test_deadline_group_batches_what_can_be_on_time():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    now = 10.0
    # a burst of five 200-token prompts that just arrived: 1.53 s together, within 2 s
    burst = [Prompt(now, 200) for _ in range(5)]
    assert deadline_group(burst, now, 2.0, cost) == ([0, 1, 2, 3, 4], True)
    # eight of them: 2.43 s together; the first six (1.83 s) can be on time, then the rest
    burst = [Prompt(now + i * 1e-3, 200) for i in range(8)]
    assert deadline_group(burst, now + 0.01, 2.0, cost) == ([0, 1, 2, 3, 4, 5], True)
    # the oldest goes first, and a big one that no longer fits is passed over for one that does
    mixed = [Prompt(now - 1.5, 200), Prompt(now - 1.0, 600), Prompt(now - 0.5, 100)]
    assert deadline_group(mixed, now, 2.0, cost) == ([0, 2], True)  # 0.48 s: all by 10.5
    # nobody can be on time: the oldest late one, alone
    late = [Prompt(now - 2.5, 100), Prompt(now - 3.0, 300), Prompt(now - 1.99, 200)]
    assert deadline_group(late, now, 2.0, cost) == ([1], False)
    assert deadline_group([Prompt(now, 10)], now, 0.0, cost) == ([0], False)  # no target


def test_late_prompts_share_a_bounded_step():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    now = 10.0
    # a backlog: nobody can be on time; oldest first, while the step stays within 0.5 s
    late = [Prompt(now - 2.5, 100), Prompt(now - 3.0, 100), Prompt(now - 2.1, 200)]
    late += [Prompt(now - 2.2, 100)]
    # 1 (0.18 s), 0 (0.33 s), 3 (0.48 s); 2 would make 0.78 s
    assert deadline_group(late, now, 2.0, cost, late_s=0.5) == ([1, 0, 3], False)
    # the oldest goes even when alone it takes longer than late_s; nobody joins it
    big = [Prompt(now - 3.0, 600), Prompt(now - 2.5, 10)]
    assert deadline_group(big, now, 2.0, cost, late_s=0.5) == ([0], False)
    # an overdue prompt with no live one to join it: late ones fill its step the same way
    overdue = [Prompt(now - 4.5, 100), Prompt(now - 2.5, 100), Prompt(now - 2.4, 300)]
    assert deadline_group(overdue, now, 2.0, cost, late_s=0.5) == ([0, 1], False)
    # a live prompt still goes on time, without the late ones
    mixed = [Prompt(now - 3.0, 100), Prompt(now, 100)]
    assert deadline_group(mixed, now, 2.0, cost, late_s=0.5) == ([1], True)


def test_an_overdue_prompt_heads_the_step_and_live_ones_join_while_they_fit():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    now = 10.0
    # live prompts keep coming; the late ones would wait for ever behind them
    prompts = [Prompt(now - 3.9, 100), Prompt(now - 4.5, 300), Prompt(now, 200), Prompt(now, 900)]
    # the 4.5 s one is overdue (2 x 2 s): it heads the step; the 200 fits beside it (0.78 s),
    # the 900 would not (2.1 s); the 3.9 s one is late, not yet overdue
    assert deadline_group(prompts, now, 2.0, cost) == ([1, 2], False)
    # had it waited 3.5 s, nobody would be overdue: the live ones go together (1.68 s), on time
    prompts[1] = Prompt(now - 3.5, 300)
    assert deadline_group(prompts, now, 2.0, cost) == ([2, 3], True)


def test_a_prefix_the_group_shares_counts_once():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    now = 10.0
    # eight 576-token prompts on one 512-token prefix (16 blocks of 32) and their own 64 tokens
    prefix = tuple(f"p{b}" for b in range(16))
    burst = [Prompt(now, 576, (*prefix, f"s{i}a", f"s{i}b")) for i in range(8)]
    assert group_tokens(burst, range(8), 32) == 576 + 7 * 64
    # all eight in one step: 1.46 s; counted as unrelated prompts only two fit (1.76 s)
    assert deadline_group(burst, now, 2.0, cost, 32) == (list(range(8)), True)
    assert deadline_group(burst, now, 2.0, cost) == ([0, 1], True)
    # only a leading run is shared (chained hashes); a fully shared prompt computes one token
    other = [Prompt(now, 96, ("x", "p1", "p2")), Prompt(now, 64, ("x", "y")), Prompt(now, 64)]
    assert group_tokens(other, [0, 1, 2], 32) == 96 + 32 + 64
    assert group_tokens([Prompt(now, 64, ("a", "b"))] * 2, [0, 1], 32) == 64 + 1


def test_chunked_on_time_counts_a_fixed_cost_per_step():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    assert chunked_on_time(300, 300, 0.48, cost)  # one step: 30 + 450 ms
    assert not chunked_on_time(300, 100, 0.48, cost)  # three steps: 90 + 450 ms
    assert chunked_on_time(300, 100, 0.54, cost)


def test_on_time_budget_splits_a_group_into_the_shortest_steps_that_stay_on_time():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    # 600 tokens (0.9 s of compute) with 2 s left: 80% of it is 1.6 s, 0.7 s spare for fixed
    # costs = 23 steps of 27 tokens, not one 0.93 s step beside the streams
    budget = on_time_budget(600, 2.0, cost)
    assert budget == 27
    assert chunked_on_time(600, budget, 0.8 * 2.0, cost)
    assert not chunked_on_time(600, budget - 2, 0.8 * 2.0, cost)  # it is about the smallest
    # no time to split: in full, one step (also when the deadline has passed)
    assert on_time_budget(600, 1.15, cost) == 600  # 0.92 - 0.9 s spare: no second step
    assert on_time_budget(600, -0.5, cost) == 600
