"""The exact offline maximum of requests whose first token can be on time: a bound for
``pdserve bench serve --find-capacity``.

Model: one machine computes prefill at ``P`` prompt tokens/s. Request ``j`` is released at its
arrival ``r_j``, needs ``p_j = c_j / P`` seconds, where ``c_j`` is the least prompt compute it
can need (below), and is on time when its prefill completes by ``d_j = r_j + D``, ``D`` the
TTFT SLO. All requests share the relative deadline ``D``, so release order is deadline order
("agreeable" jobs), and the most on-time jobs, ``1|r_j, agreeable d_j|sum U_j``, is solved
exactly in O(n^2) by Kise, Ibaraki & Mine (1978) (:func:`max_on_time`).

It is a bound for TTFT: it ignores TPOT and treats all cores as one machine at the aggregate
measured throughput, which can only help, so it is an upper bound on what any system measured
at that throughput can meet for TTFT. In more detail, it is optimistic on every count:

- ``c_j`` is the least possible prompt compute under perfect prefix caching: the prompt
  tokens after its longest prefix, in whole blocks of ``block`` tokens (the KV chunk size),
  that already appeared in any earlier-arriving request (ties in arrival: the lower index is
  earlier), and at least 1 token (the first output token needs one position computed). Every
  block is charged to the earliest-arriving request that holds it, so the charges are
  disjoint, and each must be computed after that request arrived and before its first token,
  whichever request actually computes it. Blocks of requests that end up late count as
  cached for later ones too.
- Preemption cannot help: with agreeable deadlines, earliest-deadline-first (which schedules
  any feasible set) never preempts, as a new arrival's deadline is never earlier than a
  waiting one's; so the non-preemptive optimum here is also the preemptive one, and a
  machine at ``P`` can time-share whatever cores at an aggregate ``P`` do.
- Decode steps, network and queueing overheads, and prompt-length-dependent attention cost
  are left out.

A system measured at a throughput of ``P`` cannot have more requests meet the TTFT SLO than
this number; meeting TPOT too can only lower it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.bench.serve.workloads import Request


class Job(NamedTuple):
    """One job: released at ``release``, ``processing`` seconds of work, due by ``deadline``."""

    release: float
    processing: float
    deadline: float


@dataclass(frozen=True)
class OfflineMax:
    """The bound for one workload: most requests on time, of ``total``; ``fraction`` is their
    share (1.0 for no requests); ``computed_tokens`` the least prompt compute of all."""

    on_time: int
    total: int
    fraction: float
    computed_tokens: int


def _release_order(jobs: Sequence[Job]) -> list[int]:
    return sorted(range(len(jobs)), key=lambda i: (jobs[i].release, jobs[i].deadline, i))


def _completion(seq: Sequence[int], jobs: Sequence[Job]) -> float:
    """When the last of ``seq`` completes, each started at max(release, previous completion)
    (-inf for none)."""
    end = -math.inf
    for i in seq:
        end = max(end, jobs[i].release) + jobs[i].processing
    return end


def _best_removal(seq: Sequence[int], jobs: Sequence[Job]) -> int:
    """The position in ``seq`` whose removal leaves the earliest completion (ties: the
    latest). The completion of a schedule in order is max over i of (r_i + the work from i
    on), so without position k it is max(max_{i<k} A_i - p_k, max_{i>k} A_i) with A_i = r_i +
    sum_{t>=i} p_t: O(n)."""
    n = len(seq)
    a = [0.0] * n
    suffix = 0.0
    for i in range(n - 1, -1, -1):
        suffix += jobs[seq[i]].processing
        a[i] = jobs[seq[i]].release + suffix
    after = [-math.inf] * (n + 1)  # after[i] = max(A_i..A_{n-1})
    for i in range(n - 1, -1, -1):
        after[i] = max(a[i], after[i + 1])
    best, best_end, before = 0, math.inf, -math.inf
    for k in range(n):
        end = max(before - jobs[seq[k]].processing, after[k + 1])
        if end <= best_end:
            best, best_end = k, end
        before = max(before, a[k])
    return best


def max_on_time(jobs: Sequence[Job]) -> list[int]:
    """Indices (ascending) of a largest set of ``jobs`` that can all complete by their
    deadlines on one machine: Kise, Ibaraki & Mine (1978), exact for agreeable jobs (release
    order = deadline order). Jobs are taken in release order (ties: deadline, then index);
    each joins the selected set, scheduled in that order; when it is late, the one job whose
    removal gives the earliest completion of the rest (ties: the latest-released) leaves.

    Raises:
        ValueError: the jobs are not agreeable (a later release has an earlier deadline).
    """
    order = _release_order(jobs)
    for prev, cur in itertools.pairwise(order):
        if jobs[cur].deadline < jobs[prev].deadline:
            raise ValueError(f"jobs {prev} and {cur} are not agreeable (release vs deadline)")
    selected: list[int] = []
    end = -math.inf
    for j in order:
        selected.append(j)
        end = max(end, jobs[j].release) + jobs[j].processing
        if end > jobs[j].deadline:  # with agreeable jobs only j can be late
            del selected[_best_removal(selected, jobs)]
            end = _completion(selected, jobs)
    return sorted(selected)


def computed_tokens(
    prompts: Sequence[Sequence[int]], order: Sequence[int], block: int = 16
) -> list[int]:
    """Per prompt, the least tokens it must compute when ``order`` is arrival order: its
    length less its longest prefix in whole ``block``-token blocks that an earlier prompt
    in ``order`` had, at least 1."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    root: dict = {}  # the blocks seen: a block (tuple of ids) -> the blocks seen after it
    out = [0] * len(prompts)
    for i in order:
        ids = tuple(prompts[i])
        node, matched = root, 0
        for start in range(0, len(ids) - block + 1, block):
            key = ids[start : start + block]
            if key in node and matched == start:
                matched += block
            node = node.setdefault(key, {})
        out[i] = len(ids) - min(matched, len(ids) - 1) if ids else 0
    return out


def offline_max(
    requests: Sequence[Request],
    prefill_tokens_per_s: float,
    ttft_slo_s: float,
    block: int = 16,
    releases: Sequence[float] | None = None,
) -> OfflineMax:
    """The most ``requests`` whose prefill can complete within ``ttft_slo_s`` of arrival on
    one machine at ``prefill_tokens_per_s`` (see the module docstring). Arrivals are the
    requests' ``t_s`` unless ``releases`` gives them (needed for requests sent after another
    finished, whose arrival only a run knows)."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be positive")
    if releases is None:
        if any(r.after is not None for r in requests):
            raise ValueError("requests sent after another finished need their releases")
        releases = [r.t_s for r in requests]
    if len(releases) != len(requests):
        raise ValueError("one release per request")
    tokens = _least_compute(requests, releases, block)
    jobs = [
        Job(rel, c / prefill_tokens_per_s, rel + ttft_slo_s)
        for rel, c in zip(releases, tokens, strict=True)
    ]
    on_time = len(max_on_time(jobs))
    total = len(requests)
    return OfflineMax(on_time, total, on_time / total if total else 1.0, sum(tokens))


def _least_compute(requests: Sequence[Request], releases: Sequence[float], block: int) -> list[int]:
    order = sorted(range(len(requests)), key=lambda i: (releases[i], i))
    return computed_tokens([r.prompt_token_ids for r in requests], order, block)


def any_rate_max(
    requests: Sequence[Request], prefill_tokens_per_s: float, ttft_slo_s: float, block: int = 16
) -> OfflineMax:
    """The most ``requests`` whose first token can be on time at ANY rate their arrival times
    are scaled to (a trace replayed faster or slower keeps its order and its ties), on one
    machine at ``prefill_tokens_per_s``.

    Requests that arrive at the same instant ``t`` (a trace logged in whole steps arrives in
    bursts) share one window: their charged compute (:func:`computed_tokens`, in arrival order,
    which scaling keeps) exists only from ``t`` on and is due by ``t + ttft_slo_s``, so at most
    ``P * ttft_slo_s`` tokens of it fit, and the most of them on time is the largest count
    whose smallest charges sum to at most that. Windows of different instants are counted
    apart, which can only help, so the sum over instants is an upper bound on
    :func:`offline_max` at every rate (and equal to it when bursts lie far apart, i.e. as the
    rate goes to 0). Below a target attainment, no rate reaches it at this throughput.

    Raises:
        ValueError: a request is sent after another finished (its arrival depends on a run),
            or ``prefill_tokens_per_s`` is not positive.
    """
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be positive")
    if any(r.after is not None for r in requests):
        raise ValueError("requests sent after another finished have no rate-free arrivals")
    releases = [r.t_s for r in requests]
    tokens = _least_compute(requests, releases, block)
    budget = prefill_tokens_per_s * ttft_slo_s * (1 + 1e-9)
    bursts: dict[float, list[int]] = {}
    for rel, c in zip(releases, tokens, strict=True):
        bursts.setdefault(rel, []).append(c)
    on_time = 0
    for charges in bursts.values():
        used = 0
        for c in sorted(charges):
            used += c
            if used > budget:
                break
            on_time += 1
    total = len(requests)
    return OfflineMax(on_time, total, on_time / total if total else 1.0, sum(tokens))
