"""The scheduler's step budget: a learnt step-cost model and the prompt tokens a step may
take beside decoding streams without pushing any of them past its TPOT target."""

from __future__ import annotations

import pytest

from pdserve.engines.step_budget import StepCost, prompt_budget

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


def test_new_stream_allows_one_target_of_prefill():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    # a stream whose first token came out just now, one token so far
    assert prompt_budget([(10.0, 1)], 10.0, TARGET, cost, 32) == 80  # (150 - 30) / 1.5


def test_slack_banked_by_fast_steps_lets_a_whole_prompt_through():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    # 5 tokens after 4 fast steps of 30 ms: 5 * 150 - 120 = 630 ms allowed
    assert prompt_budget([(10.0, 5)], 10.120, TARGET, cost, 32) == 400


def test_the_stream_with_least_slack_decides_and_progress_is_guaranteed():
    cost = StepCost(fixed_s=0.030, per_token_s=0.0015)
    ahead, behind = (10.0, 5), (10.0, 2)  # behind: 2 tokens in 0.5 s, over target
    assert prompt_budget([ahead, behind], 10.5, TARGET, cost, 32) == 32
    assert prompt_budget([ahead], 10.5, TARGET, cost, 32) == 146  # (750 - 500 - 30) / 1.5
