"""``pdserve bench chaos``'s recovery figures, from recorded answers (no cluster)."""

from __future__ import annotations

from pdserve.bench.chaos import Outcome
from pdserve.bench.chaos_recovery import store_served_s

REFS = ["right 0", "right 1"]


def _answer(start: float, end: float, cached: int, *, prompt: int = 0, ok: bool = True) -> Outcome:
    return Outcome(start, end, prompt, 200 if ok else 503, REFS[prompt] if ok else "", cached)


def test_store_served_counts_from_the_fault_to_the_first_answer_that_stays_from_the_store():
    answers = [
        _answer(9.0, 10.5, 16),  # sent before the fault: left out
        _answer(10.1, 10.2, 0),  # recomputed: the store was out of reach
        _answer(10.2, 12.0, 16),  # sent early, answered late: from the store...
        _answer(11.0, 12.1, 0, prompt=1),  # ...but a later answer was not
        _answer(12.2, 12.5, 16, prompt=1),  # from here on every answer loads from the store
        _answer(12.3, 12.6, 32),
        _answer(12.0, 13.0, 16, prompt=-1),  # unscored (fresh prompts): left out
    ]
    assert store_served_s(answers, REFS, 10.0) == 2.5


def test_a_wrong_or_failed_answer_after_the_fault_starts_the_count_over():
    wrong = Outcome(10.6, 10.7, 1, 200, "wrong", 16)
    answers = [_answer(10.1, 10.5, 16), wrong, _answer(10.8, 11.0, 16)]
    assert store_served_s(answers, REFS, 10.0) == 1.0
    assert store_served_s([*answers, _answer(11.1, 11.2, 16, ok=False)], REFS, 10.0) is None
    assert store_served_s([], REFS, 10.0) is None
