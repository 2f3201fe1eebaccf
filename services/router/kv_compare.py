"""The KV check's verdict and its SLO (plain logic, no I/O; ``kv_check.py`` runs the check).

:func:`compare` judges two greedy runs of one prompt: the *stored* run (its prompt KV loaded
from the store, or from the worker's prefix cache that a load filled) and the *cold* run (the
prompt computed from scratch). Where their tokens first differ, the *logit gap* is the cold
run's log probability of its own token minus its log probability of the token the stored run
chose (nats, >= 0). A flip at a near tie is numerics, not a wrong KV: bfloat16 cached and cold
prefills can choose differently where two tokens are within a few hundredths of a nat
(docs/router.md, "KV check"). So a flip is a divergence only when the gap exceeds the
tolerance.

:class:`DivergenceWindow` keeps the last ``window`` verdicts of each fingerprint and says when
its divergence rate breaches the SLO.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.requests import TokenLogprob

#: Verdicts: all tokens equal; a flip within the tolerance; a flip beyond it.
MATCH = "match"
NEAR_TIE = "near_tie"
DIVERGENT = "divergent"


@dataclass(frozen=True)
class Run:
    """One greedy run as the worker streamed it."""

    tokens: list[int]
    #: One per token, with the top alternatives (``Sampling.logprobs``).
    logprobs: list[TokenLogprob]
    #: Prompt tokens whose KV came from the store / the worker's own prefix cache.
    loaded_tokens: int = 0
    prefix_cached_tokens: int = 0


@dataclass(frozen=True)
class Verdict:
    outcome: str
    #: Index of the first differing token (-1: none within the shorter run).
    position: int = -1
    #: Logit gap at ``position`` (nats; 0 without a flip; ``inf`` when the cold run's logprobs
    #: do not say). ``gap_is_bound``: the stored token was not among the cold run's top
    #: alternatives, so the gap is at least this (the distance to the last one listed).
    gap: float = 0.0
    gap_is_bound: bool = False


def cold_logprob(lp: TokenLogprob, token: int) -> tuple[float, bool]:
    """The cold run's log probability of ``token`` at this position, and whether it is only
    an upper bound (``token`` is not among the listed alternatives: it is at most the least
    likely one listed; ``-inf`` when none is listed)."""
    if lp.token_id == token:
        return lp.logprob, False
    for t, value in lp.top:
        if t == token:
            return value, False
    least = min((value for _, value in lp.top), default=-math.inf)
    return least, True


def compare(stored: Run, cold: Run, tolerance: float) -> Verdict:
    """The verdict on ``stored`` against ``cold`` (see the module docstring): compared token
    by token up to the shorter run; at the first difference, the logit gap decides between
    :data:`NEAR_TIE` (``gap <= tolerance``) and :data:`DIVERGENT`."""
    n = min(len(stored.tokens), len(cold.tokens))
    for i in range(n):
        if stored.tokens[i] == cold.tokens[i]:
            continue
        if i >= len(cold.logprobs):
            return Verdict(DIVERGENT, i, math.inf, True)
        lp = cold.logprobs[i]
        other, bound = cold_logprob(lp, stored.tokens[i])
        gap = max(0.0, lp.logprob - other)
        return Verdict(DIVERGENT if gap > tolerance else NEAR_TIE, i, gap, bound)
    return Verdict(MATCH)


class DivergenceWindow:
    """The last ``window`` verdicts of each fingerprint (True = divergent). The SLO is
    breached when at least ``min_checks`` are held and the share of divergent ones exceeds
    ``max_divergence``."""

    def __init__(self, window: int, min_checks: int, max_divergence: float) -> None:
        self.window = window
        self.min_checks = min_checks
        self.max_divergence = max_divergence
        self.verdicts: dict[str, deque[bool]] = {}

    def record(self, fingerprint: str, divergent: bool) -> float:
        """Adds one verdict; returns the fingerprint's divergence rate over its window."""
        held = self.verdicts.setdefault(fingerprint, deque(maxlen=self.window))
        held.append(divergent)
        return self.rate(fingerprint)

    def rate(self, fingerprint: str) -> float:
        held = self.verdicts.get(fingerprint)
        return sum(held) / len(held) if held else 0.0

    def breached(self, fingerprint: str) -> bool:
        held = self.verdicts.get(fingerprint, ())
        return len(held) >= self.min_checks and self.rate(fingerprint) > self.max_divergence

    def evidence(self, fingerprint: str) -> str:
        """The window in words, for the log and the quarantine's reason."""
        held: Sequence[bool] = self.verdicts.get(fingerprint, ())
        return (
            f"{sum(held)} of the last {len(held)} checks diverged (rate "
            f"{self.rate(fingerprint):.2f} > {self.max_divergence})"
        )

    def reset(self, fingerprint: str) -> None:
        """Forgets the fingerprint's verdicts (its quarantine ended: a fresh start)."""
        self.verdicts.pop(fingerprint, None)
