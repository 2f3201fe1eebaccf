"""vLLM's scheduler with a step budget sized to the streams' time-per-output-token target.

On a CPU core a step costs about ``fixed + per_token * prompt tokens`` (SmolLM2 bf16 on one
core: ~30 ms to stream the weights once, ~1.7 ms per prompt token), and every running stream
waits for the whole step. vLLM's CPU default of 2048 tokens per step lets one prompt's prefill
stretch a step beside running streams to half a second; a small static budget instead slows
every prefill, even when the streams are far ahead of their target.

So each step gets the largest prompt budget that keeps every decoding stream's time per
output token (vLLM's TPOT: first to last token, over the tokens after the first) projected
within ``tpot_target_ms``: its time so far, plus this step, plus the tokens it is expected to
produce next (as many again as so far, at least 4, at most its ``max_tokens``) at a
decode-only step each:

    allowed step = min over streams (target * (tokens + future) - time since first
                                     - future * fixed)
    prompt tokens = (allowed - fixed) / per_token        (at least one block, for progress)

A young stream with tokens to come absorbs one long prefill step over all of them, as vLLM's
prefill-first default does; a stream that is behind, or about to end, gets short steps until
it is done. With no stream decoding, prompts prefill in full ``max_num_batched_tokens`` steps.
``fixed`` and ``per_token`` are learnt from the engine's own step times (EWMA), so the budget
follows the model and the machine.

Prompts are not starved for it: one that has waited ``ttft_urgent_ms`` since it arrived gets
its whole remaining prompt into the next step, streams or not (a stream absorbs one long step
over all its tokens; a first token that misses its target is lost for good).

Which new prompts a step may take is ``prefill_order``'s. A step's time grows with its prompt
tokens, and each prompt in it gets its first token only when the step ends. vLLM puts every
waiting prompt into the next step; ``deadline`` (the default) gives each prompt the deadline
``arrival + ttft_target_ms`` and lets into the step only the prompts that can all still be on
time together, oldest first (:func:`~pdserve.engines.step_budget.deadline_group`; a prefix
they share counts once, as vLLM computes it once): a burst that fits is batched as vLLM does,
and of a burst too large for its time, what can be on time goes first instead of every prompt
being late. When the streams' budget would make that group late, its steps grow just enough
for it to be on time (:func:`~pdserve.engines.step_budget.on_time_budget`: many short steps
where the time left allows, its whole prompt in one step only where it does not), unless
those steps take more on-time streams past ``tpot_target_ms`` than the group has prompts
(:func:`~pdserve.engines.step_budget.streams_overrun`): a request counts once, on time in both
or not. A tie goes to the prompts: a first token after its deadline is lost for sure, a stream
past the target is a projection and may still be within its SLO. With none
on time, late prompts go together, oldest first, in a step of at most a quarter of
``ttft_target_ms``, and are never urgent (their first token is lost to the target either way:
a backlog drains fastest in steps that pay the fixed cost once for several of them, and a
bounded step keeps the next live prompt's wait short); one that has waited twice
``ttft_target_ms`` heads the next step, so a steady stream of live prompts cannot starve it.
A stream whose first token came after ``ttft_target_ms`` does not limit the step budget: its
request has missed its SLO whatever its later tokens do, and in a backlog, where every stream
is late, steps keeping them to ``tpot_target_ms`` would cut the prompt throughput that drains
it (one block per step beside a stream that is behind). The other way round, prompts past
their deadline (none overdue) get no prompt tokens in a step the on-time streams need whole:
their first token is lost whatever the step does, while a block forced into every step (the
floor that keeps prompts progressing) made each step longer than the decode-only steps the
budget had counted on, and took on-time streams past their TPOT (a burst's first streams at
217-241 ms against a 150 ms target, float32, 2026-12-05). The others are held out of vLLM's
waiting queue for the step and put back after it; ``shortest`` and ``arrival`` take one prompt
per step.

While every request the engine holds is waiting for its KV to arrive (write mode's
asynchronous load, :mod:`pdserve.engines.vllm_connector`) and nothing else is runnable, each
step waits ``REMOTE_KV_IDLE_S`` first. vLLM's own loop would run about a thousand empty steps a
second to learn when the load is done, measured here at more than a whole core (engine core
plus worker process) taken from the prefill computing those very chunks. The price: a request
arriving meanwhile starts up to that much later, and a finished load is noticed that much later.

Requests carry vLLM's ``priority`` (lower first; the router sends the caller's with its
tenant's fairness rank, services/router/fair_queue.py ``engine_priority``). Under vLLM's
default ``fcfs`` policy, which vLLM itself runs in arrival order, the waiting queue is kept in
priority order (arrival order within one priority, preempted requests first, as vLLM's
``priority`` policy orders them) and the new prompts ``prefill_order`` picks from are those of
the best priority waiting: a prompt is never held back for one of a worse priority. Running
streams are not preempted for priority (vLLM's ``priority`` policy, set with
``vllm_args: {scheduling_policy: priority}``, does that, without ``prefill_order``).

Loaded inside vLLM's engine core through ``scheduler_cls``; the settings come from
``additional_config`` (``pdserve_tpot_target_ms``, ``pdserve_ttft_urgent_ms``,
``pdserve_ttft_target_ms``; 0 = off; ``pdserve_prefill_order``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from pdserve.engines.step_budget import (
    LATE_STEP_TARGETS,
    OVERDUE_TARGETS,
    PREFILL_ORDER_KEY,
    TPOT_TARGET_KEY,
    TTFT_TARGET_KEY,
    TTFT_URGENT_KEY,
    Prompt,
    StepCost,
    Stream,
    chunked_on_time,
    deadline_group,
    group_tokens,
    next_prompt,
    on_time_budget,
    prompt_budget,
    streams_overrun,
)

#: Pause before a step while the engine only waits for asynchronous KV loads (seconds).
REMOTE_KV_IDLE_S = 0.01
#: ``deadline``: an idle engine waits for a burst's requests while they come less than
#: GATHER_QUIET_S apart, for at most GATHER_MAX_S after the first, polling every GATHER_POLL_S.
GATHER_QUIET_S = 0.010
GATHER_MAX_S = 0.060
GATHER_POLL_S = 0.002


@dataclass
class Pick:
    """What :meth:`StreamFirstScheduler._pick_prompts` decided for one step."""

    held: list[Request] = field(default_factory=list)  # new prompts kept out of this step
    gathering: bool = False  # nothing picked: waiting for the rest of a burst
    deadline: float = 0.0  # wall clock: the on-time group's first-token deadline (0 = none)
    tokens: int = 0  # the on-time group's prompt tokens still to compute
    prompts: int = 0  # the on-time group's prompts
    #: ``deadline``: every prompt of the step is past its first-token deadline and none is
    #: overdue, so they may get no tokens while the on-time streams need the whole step
    may_wait: bool = False


class StreamFirstScheduler(Scheduler):
    """vLLM's scheduler with the step budget of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        self.tpot_target_s = float(extra.get(TPOT_TARGET_KEY, 0)) / 1000.0
        self.ttft_urgent_s = float(extra.get(TTFT_URGENT_KEY, 0)) / 1000.0
        self.ttft_target_s = float(extra.get(TTFT_TARGET_KEY, 0)) / 1000.0
        self.prefill_order = str(extra.get(PREFILL_ORDER_KEY, "batched"))
        self.full_step_tokens = self.max_num_scheduled_tokens
        self.cost = StepCost()
        #: request id -> (when its first token was seen, whether it came after the target)
        self._first_token_at: dict[str, tuple[float, bool]] = {}
        self._step_started = 0.0
        self._step_prompt_tokens = 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._only_waiting_for_kv():
            time.sleep(REMOTE_KV_IDLE_S)
        now = time.monotonic()
        seen = self._first_token_at
        live: dict[str, tuple[float, bool]] = {}
        streams = []  # the decoding streams whose first token was on time
        decoding = 0  # all decoding streams: one token each in the step
        for r in self.running:
            if r.num_computed_tokens >= r.num_prompt_tokens and r.num_output_tokens > 0:
                decoding += 1
                first, late = live[r.request_id] = seen.get(r.request_id) or (
                    now,
                    self._late_first_token(r),
                )
                if not late:
                    streams.append(Stream(first, r.num_output_tokens, r.max_tokens))
        self._first_token_at = live
        self._order_by_priority()
        pick = self._pick_prompts()
        try:
            if streams and self.tpot_target_s > 0:
                floor = 0 if pick.may_wait else self.cache_config.block_size
                budget = prompt_budget(streams, now, self.tpot_target_s, self.cost, floor)
                if self.prefill_order != "deadline":
                    budget = max(budget, self._urgent_prompt_tokens())
                elif pick.deadline:
                    left = pick.deadline - time.time()
                    if not chunked_on_time(pick.tokens, budget, left, self.cost):
                        # larger steps, just enough for the group to be on time, unless
                        # that takes more on-time streams past their target than it saves
                        grown = on_time_budget(pick.tokens, left, self.cost)
                        lost = streams_overrun(streams, now, self.tpot_target_s, self.cost, grown)
                        if pick.prompts >= lost:
                            budget = max(budget, grown)
                self.max_num_scheduled_tokens = min(self.full_step_tokens, decoding + budget)
            else:
                self.max_num_scheduled_tokens = self.full_step_tokens
            out = super().schedule(*args, **kwargs)
        finally:
            self.waiting.extend(pick.held)
        if pick.gathering:
            time.sleep(GATHER_POLL_S)
        total = sum(out.num_scheduled_tokens.values())
        self._step_started = time.monotonic()
        self._step_prompt_tokens = max(0, total - decoding)
        return out

    def _order_by_priority(self) -> None:
        """Under ``fcfs``: the waiting queue sorted by priority, stably (the module docstring;
        no work while every request has the same priority)."""
        queue = self.waiting
        if self.policy != SchedulingPolicy.FCFS or len({r.priority for r in queue}) < 2:
            return
        ordered = sorted(queue, key=lambda r: r.priority)
        queue.clear()
        queue.extend(ordered)

    def _pick_prompts(self) -> Pick:
        """Leaves in the waiting queue, for this step, only the new prompts ``prefill_order``
        picks (:func:`~pdserve.engines.step_budget.deadline_group` or
        :func:`~pdserve.engines.step_budget.next_prompt`) and holds the others back. While a
        prompt is part-way through its prefill none is picked (vLLM finishes that one first;
        under ``deadline`` it is the group). Under ``deadline``, while the engine is idle and
        prompts are still arriving (the last less than ``GATHER_QUIET_S`` ago, the first less
        than ``GATHER_MAX_S``), none is picked either: a burst reaches the engine over some
        milliseconds, one request after another, and taking the first alone would give it a
        step of its own and its stream a long wait behind the rest. Requests vLLM must see
        (preempted ones, ones waiting for KV or a grammar) always stay."""
        queue = self.waiting
        order = self.prefill_order
        if order == "batched" or self.policy != SchedulingPolicy.FCFS:
            return Pick()
        new = [r for r in queue if r.status == RequestStatus.WAITING and not r.num_computed_tokens]
        # the best priority's prompts only (lower first): the others wait for them
        top = min((r.priority for r in new), default=0)
        best = [r for r in new if r.priority == top]
        partial = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        now = time.time()
        block = self.cache_config.block_size
        prompts: list[Prompt] = []
        picked: list[int] = []
        if partial:
            chosen: list[Request] = []
            group = partial
        elif not new:
            return Pick()
        elif order == "deadline" and not self.running and self._still_arriving(new, now):
            chosen = group = []
        else:
            prompts = [self._prompt(r, block) for r in best]
            if order == "deadline":
                picked, _ = deadline_group(
                    prompts,
                    now,
                    self.ttft_target_s,
                    self.cost,
                    block,
                    late_s=LATE_STEP_TARGETS * self.ttft_target_s,
                )
                # whether the group is on time is checked below, alike for a part-way prompt
            else:
                picked = [next_prompt(prompts, now, self.ttft_urgent_s, order)]
            chosen = group = [best[i] for i in picked]
        pick = Pick(gathering=not group)
        if order == "deadline" and group and self.ttft_target_s > 0:
            if chosen:
                tokens = group_tokens(prompts, picked, block)
            else:  # part-way: its cache hits are in num_computed_tokens
                tokens = sum(r.num_tokens - r.num_computed_tokens for r in group)
            deadline = min(r.arrival_time for r in group) + self.ttft_target_s
            if now + self.cost.step_s(tokens) <= deadline:
                pick.deadline, pick.tokens, pick.prompts = deadline, tokens, len(group)
            else:  # late: those whose deadline has passed (not only by the cost model's
                # projection, which can be wrong) may wait, unless overdue
                passed = now - self.ttft_target_s  # arrived by then: deadline passed
                overdue = now - OVERDUE_TARGETS * self.ttft_target_s
                pick.may_wait = all(overdue < r.arrival_time <= passed for r in group)
        ids = {id(r) for r in chosen}
        pick.held = [r for r in new if id(r) not in ids]
        if pick.held:
            kept = [r for r in queue if r.status != RequestStatus.WAITING or r.num_computed_tokens]
            queue.clear()
            queue.extend(kept + chosen)
        return pick

    def _late_first_token(self, request: Request) -> bool:
        """Under ``deadline``: the request's first token came after ``ttft_target_ms`` (its
        SLO is lost whatever its later tokens do, so its stream does not limit the steps)."""
        return (
            self.prefill_order == "deadline"
            and self.ttft_target_s > 0
            and time.time() - request.arrival_time > self.ttft_target_s
        )

    @staticmethod
    def _still_arriving(new: list[Request], now: float) -> bool:
        first = min(r.arrival_time for r in new)
        last = max(r.arrival_time for r in new)
        return now - last < GATHER_QUIET_S and now - first < GATHER_MAX_S

    def _prompt(self, request: Request, block: int) -> Prompt:
        """``request`` as the order sees it: the prompt tokens it would compute, less this
        engine's prefix-cache hit, and the hashes of the full blocks it would compute."""
        try:
            hit = self.kv_cache_manager.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1
            )[1]
        except Exception:  # an estimate only: any lookup failure counts as no hit
            hit = 0
        blocks = tuple(request.block_hashes[hit // block :])
        return Prompt(request.arrival_time, request.num_tokens - hit, blocks)

    def _only_waiting_for_kv(self) -> bool:
        """Nothing to compute or clean up: every request waits for an asynchronous KV load
        that has not finished."""
        return (
            not self.running
            and not self.waiting
            and not self.finished_req_ids
            and not self.finished_recving_kv_req_ids
            and len(self.kv_holding_waiting) > 0
            and all(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.kv_holding_waiting
            )
        )

    def _urgent_prompt_tokens(self) -> int:
        """Prompt tokens still to compute of the prompts in this step waiting longer than
        ttft_urgent_ms (arrival times are wall-clock, stamped by vLLM's front end on this
        host)."""
        if self.ttft_urgent_s <= 0:
            return 0
        since = time.time() - self.ttft_urgent_s
        return sum(
            r.num_prompt_tokens - r.num_computed_tokens
            for r in itertools.chain(self.running, self.waiting)
            if r.num_computed_tokens < r.num_prompt_tokens and r.arrival_time < since
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._step_started and scheduler_output.total_num_scheduled_tokens:
            self.cost.observe(time.monotonic() - self._step_started, self._step_prompt_tokens)
        self._step_started = 0.0
        return super().update_from_output(scheduler_output, model_runner_output)
