"""The scheduler's step budget: a learnt step-cost model and the prompt tokens a step may
take beside decoding streams without pushing any of them past its TPOT target."""

from __future__ import annotations

import pytest

from pdserve.engines.step_budget import StepCost, Stream, future_tokens, prompt_budget

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
