"""The wrong-API-key budgets (pdserve/auth.py KeyFailures, refusal): counted per address and
key, and over all addresses; a wrong key past a budget is answered 429 with how long to wait;
the right key is never refused, from the same address either. A fake clock, no network."""

from __future__ import annotations

import pytest

from pdserve import auth
from pdserve.tenants import Tenants

KEY = "s3cret-key"
RIGHT = f"Bearer {KEY}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refusal(header, peer, failures):
    return auth.refusal(header, Tenants.configured(KEY), peer, failures)


def test_the_same_wrong_key_from_an_address_is_answered_429_but_the_right_key_is_served():
    clock = Clock()
    failures = auth.KeyFailures(3, 60.0, global_limit=0, clock=clock)
    for _ in range(3):
        assert _refusal("Bearer nope", "10.0.0.1", failures) == (auth.WRONG_KEY, 0.0)
        clock.now += 1
    why, wait = _refusal("Bearer nope", "10.0.0.1", failures)
    assert "too many wrong API keys" in why and "57 s" in why and wait == pytest.approx(57)
    # the right key from the same address (a NAT, a gateway) is served: never locked out
    assert _refusal(RIGHT, "10.0.0.1", failures) == ("", 0.0)
    # another wrong key from it, and the same wrong key from elsewhere, are within budget
    assert _refusal("Bearer other", "10.0.0.1", failures) == (auth.WRONG_KEY, 0.0)
    assert _refusal("Bearer nope", "10.0.0.2", failures) == (auth.WRONG_KEY, 0.0)
    clock.now = 160.0  # the pair's window (from its first wrong key, at 100) has ended
    assert _refusal("Bearer nope", "10.0.0.1", failures) == (auth.WRONG_KEY, 0.0)


def test_wrong_keys_spread_over_many_addresses_pass_the_global_budget():
    """The review's figure: 2,000 wrong keys from 223 addresses, each address under its own
    budget, were never limited; past the global one each is answered 429 (the right key not)."""
    clock = Clock()
    failures = auth.KeyFailures(10, 60.0, global_limit=100, clock=clock)
    answers = []
    for i in range(2000):
        answers.append(_refusal(f"Bearer guess-{i}", f"10.0.0.{i % 223}", failures))
        clock.now += 0.01  # 20 s in all: one window
    assert [why for why, _ in answers[:100]] == [auth.WRONG_KEY] * 100
    slowed = answers[100:]
    assert all(wait > 0 and "too many wrong API keys" in why for why, wait in slowed)
    assert slowed[-1][1] == pytest.approx(60 - 20, abs=0.1)  # until the global window ends
    assert all(_refusal(RIGHT, f"10.0.0.{i}", failures) == ("", 0.0) for i in range(223))
    clock.now += 60  # a new window: the budget is whole again
    assert _refusal("Bearer guess-x", "10.0.0.9", failures) == (auth.WRONG_KEY, 0.0)


def test_missing_and_malformed_keys_guess_nothing_and_are_not_counted():
    failures = auth.KeyFailures(1, 60.0, global_limit=1, clock=Clock())
    for header in (None, KEY, "Basic abc") * 5:
        why, wait = _refusal(header, "10.0.0.3", failures)
        assert why and wait == 0.0
    assert not failures.windows and failures.everyone[1] == 0


def test_budgets_at_zero_are_off():
    failures = auth.KeyFailures(0, 60.0, global_limit=0, clock=Clock())
    assert all(
        _refusal("Bearer nope", "10.0.0.1", failures) == (auth.WRONG_KEY, 0.0) for _ in range(50)
    )
    assert not failures.windows


def test_memory_is_bounded_by_max_peers_oldest_window_first():
    clock = Clock()
    failures = auth.KeyFailures(2, 10.0, global_limit=0, max_peers=3, clock=clock)
    assert failures.failed("a", "k") == 0.0
    clock.now += 11  # a new window: the count restarts
    assert failures.failed("a", "k") == 0.0
    for peer in ("b", "c", "d"):
        failures.failed(peer, "k")
    assert [peer for peer, _ in failures.windows] == ["b", "c", "d"]  # "a" forgotten
    failures.failed("d", "k")
    assert failures.failed("d", "k") == pytest.approx(10.0)
    assert all(len(digest) == 32 for _, digest in failures.windows)  # digests, not keys
