"""The exact offline bound of ``--find-capacity``: Kise-Ibaraki-Mine against brute force on
random small instances, obvious cases, and the least prompt compute under perfect prefix
caching."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from pdserve.bench.serve.offline_max import (
    Job,
    any_rate_max,
    computed_tokens,
    max_on_time,
    offline_max,
)
from pdserve.bench.serve.workloads import Request


def _order(jobs: Sequence[Job]) -> list[int]:
    return sorted(range(len(jobs)), key=lambda i: (jobs[i].release, jobs[i].deadline, i))


def _feasible(jobs: Sequence[Job], subset: Sequence[int]) -> bool:
    """Every job of ``subset`` on time when scheduled in release order, each started at
    max(release, previous completion)."""
    chosen = set(subset)
    end = -math.inf
    for i in _order(jobs):
        if i in chosen:
            end = max(end, jobs[i].release) + jobs[i].processing
            if end > jobs[i].deadline:
                return False
    return True


def brute_force_max(jobs: Sequence[Job]) -> int:
    """The most jobs on time, over every subset (release order is optimal for a fixed
    agreeable set: EDF)."""
    n = len(jobs)
    return max(
        bin(mask).count("1")
        for mask in range(1 << n)
        if _feasible(jobs, [i for i in range(n) if mask >> i & 1])
    )


def _random_jobs(rng: random.Random) -> list[Job]:
    n = rng.randint(1, 10)
    kind = rng.choice(["int", "float", "common"])
    if kind == "int":  # small integers: many ties, equal releases
        rel = sorted(rng.randint(0, 6) for _ in range(n))
        proc = [rng.randint(0, 4) for _ in range(n)]
        slack = sorted(rng.randint(0, 8) for _ in range(n))
        dl = sorted(r + s for r, s in zip(rel, slack, strict=True))
    else:
        rel = sorted(rng.uniform(0, 10) for _ in range(n))
        if rng.random() < 0.3:
            rel = [round(r) * 1.0 for r in rel]  # equal releases among floats
        proc = [rng.uniform(0, 4) for _ in range(n)]
        if kind == "common":  # the benchmark's case: a common relative deadline
            d = rng.uniform(0.5, 6)
            dl = [r + d for r in rel]
        else:
            dl = sorted(r + rng.uniform(0, 8) for r in rel)
    jobs = [Job(float(r), float(p), float(d)) for r, p, d in zip(rel, proc, dl, strict=True)]
    rng.shuffle(jobs)  # input order must not matter
    return jobs


def test_kim_equals_brute_force_on_random_instances() -> None:
    rng = random.Random(1978)
    for _ in range(400):
        jobs = _random_jobs(rng)
        chosen = max_on_time(jobs)
        assert _feasible(jobs, chosen), jobs
        assert len(chosen) == brute_force_max(jobs), jobs


def test_everything_fits() -> None:
    jobs = [Job(float(i), 1.0, i + 2.0) for i in range(6)]
    assert max_on_time(jobs) == list(range(6))


def test_one_huge_job_is_dropped() -> None:
    jobs = [Job(0.0, 1.0, 3.0), Job(1.0, 50.0, 4.0), Job(2.0, 1.0, 5.0), Job(3.0, 1.0, 6.0)]
    assert max_on_time(jobs) == [0, 2, 3]


def test_huge_job_that_fits_alone_gives_way_to_several() -> None:
    # The big job alone is on time, but it would make the three after it late.
    jobs = [Job(0.0, 2.9, 3.0), Job(0.5, 1.0, 3.5), Job(1.0, 1.0, 4.0), Job(1.5, 1.0, 4.5)]
    assert max_on_time(jobs) == [1, 2, 3]


def test_burst_of_equal_releases() -> None:
    # 10 jobs of 1 s at once, 3.5 s deadline: 3 fit; ties keep the earliest indices.
    jobs = [Job(0.0, 1.0, 3.5)] * 10
    assert max_on_time(jobs) == [0, 1, 2]
    assert brute_force_max(jobs) == 3


def test_not_agreeable_is_refused() -> None:
    with pytest.raises(ValueError, match="agreeable"):
        max_on_time([Job(0.0, 1.0, 5.0), Job(1.0, 1.0, 2.0)])


def test_empty() -> None:
    assert max_on_time([]) == []
    assert offline_max([], 100.0, 1.0).fraction == 1.0


# --- least prompt compute --------------------------------------------------------------------


def test_computed_tokens_counts_whole_blocks_seen_earlier() -> None:
    a = tuple(range(100, 140))  # 40 tokens: 2 whole blocks of 16 + 8
    b = a[:32] + (1,) * 10  # shares a's 2 blocks
    c = a[:20] + (2,) * 20  # shares 1 block (the second differs)
    d = a[:32]  # all cached: still 1 token computed
    e = (3,) * 16 + a[16:32]  # different first block: nothing shared
    prompts = [a, b, c, d, e]
    assert computed_tokens(prompts, range(5), 16) == [40, 10, 24, 1, 32]
    # arrival order decides who is earlier: b first computes everything, a then 8
    assert computed_tokens(prompts, [1, 0, 2, 3, 4], 16) == [8, 42, 24, 1, 32]
    assert computed_tokens([a, a], [0, 1], 8) == [40, 1]
    assert computed_tokens([(), (5,)], [0, 1], 16) == [0, 1]


def test_offline_max_uses_least_compute_and_arrivals() -> None:
    shared = tuple(range(100, 132))  # 2 blocks
    reqs = [Request(0.0, shared + (7,) * 8, 4), Request(0.0, shared + (8,) * 8, 4)]
    # 100 tok/s: first needs 0.40 s, second 0.08 s (its 2 blocks are cached): both by 0.5 s
    both = offline_max(reqs, 100.0, 0.5)
    assert (both.on_time, both.total, both.computed_tokens) == (2, 2, 48)
    assert both.fraction == 1.0
    assert offline_max(reqs, 100.0, 0.45).on_time == 1
    # arrivals 1 s apart: each has its own window
    spaced = [reqs[0], Request(1.0, reqs[1].prompt_token_ids, 4)]
    assert offline_max(spaced, 100.0, 0.45).on_time == 2
    # releases override t_s; requests sent after another need them
    late = [reqs[0], Request(0.5, reqs[1].prompt_token_ids, 4, after=0)]
    with pytest.raises(ValueError, match="releases"):
        offline_max(late, 100.0, 0.45)
    assert offline_max(late, 100.0, 0.45, releases=[0.0, 0.3]).on_time == 2
    with pytest.raises(ValueError):
        offline_max(reqs, 0.0, 1.0)


# --- the bound at any rate --------------------------------------------------------------------


def _bursty_requests(rng: random.Random) -> list[Request]:
    """Requests in bursts at whole seconds, prompts sharing a system block and some turns."""
    system = tuple(range(200, 216))
    out: list[Request] = []
    for i in range(rng.randint(1, 14)):
        t = float(rng.randint(0, 4))
        own = tuple(rng.randint(300, 310) for _ in range(16 * rng.randint(0, 4)))
        prev = rng.choice(out).prompt_token_ids if out and rng.random() < 0.3 else system
        out.append(Request(t, prev + own + (i,), 1))
    return sorted(out, key=lambda r: r.t_s)


def test_any_rate_max_bounds_every_rate_and_is_reached_when_bursts_lie_apart() -> None:
    rng = random.Random(11)
    for _ in range(300):
        reqs = _bursty_requests(rng)
        p, d = rng.uniform(20, 200), rng.uniform(0.2, 2.0)
        ceiling = any_rate_max(reqs, p, d)
        for m in (0.05, 0.5, 1.0, 4.0):  # the trace replayed at m times its rate
            scaled = [Request(r.t_s / m, r.prompt_token_ids, r.max_tokens) for r in reqs]
            assert offline_max(scaled, p, d).on_time <= ceiling.on_time
        slow = 1e6  # bursts a million seconds apart: no window overlaps another
        apart = [Request(r.t_s * slow, r.prompt_token_ids, r.max_tokens) for r in reqs]
        assert offline_max(apart, p, d).on_time == ceiling.on_time
        assert ceiling.computed_tokens == offline_max(reqs, p, d).computed_tokens


def test_any_rate_max_counts_each_burst_in_its_own_window() -> None:
    a, b, c = ((i,) * 40 for i in (101, 102, 103))
    # 100 tok/s, 1 s: 100 tokens per burst window; three 40-token prompts at once -> 2 fit
    burst = [Request(0.0, a, 1), Request(0.0, b, 1), Request(0.0, c, 1)]
    got = any_rate_max(burst, 100.0, 1.0)
    assert (got.on_time, got.total, got.fraction) == (2, 3, 2 / 3)
    # the same prompts spread over three instants: every one fits at a slow enough rate
    spread = [Request(float(i), r.prompt_token_ids, 1) for i, r in enumerate(burst)]
    assert any_rate_max(spread, 100.0, 1.0).on_time == 3
    # a prompt longer than the window never fits, at any rate
    assert any_rate_max([Request(0.0, (5,) * 150, 1)], 100.0, 1.0).on_time == 0
    assert any_rate_max([], 100.0, 1.0).fraction == 1.0
    with pytest.raises(ValueError, match="after another"):
        any_rate_max([burst[0], Request(0.5, b, 1, after=0)], 100.0, 1.0)
    with pytest.raises(ValueError):
        any_rate_max(burst, 0.0, 1.0)
