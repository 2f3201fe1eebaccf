"""The KV check without a network: the comparator, the SLO window, the sampler and the check
itself against a scripted in-process worker, and the orchestrator's side (sampling, no store
hits counted and rotated salts while a fingerprint is quarantined)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.config import ConfigError
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.requests import Sampling, TokenLogprob
from pdserve.services.router import kv_check as kc
from pdserve.services.router.admission import Admission
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.kv_compare import (
    DIVERGENT,
    MATCH,
    NEAR_TIE,
    DivergenceWindow,
    Run,
    compare,
)
from pdserve.services.router.orchestrator import Orchestrator, OrchestratorConfig
from pdserve.services.router.plan import Plan
from pdserve.services.router.policies import RoundRobin
from pdserve.services.router.request import GenRequest
from pdserve.services.router.trace import Trace
from pdserve.services.router.worker_client import DecodeCall, WorkerCallError, WorkerClient
from pdserve.services.router.workers import DECODE, WorkerPool
from pdserve.telemetry import REGISTRY
from pdserve.v1 import common_pb2, engine_pb2

FP = ModelFingerprint(model_id="tiny", revision="r", chunk_size=4)
FP_HEX = FP.digest().hex()
PROMPT = list(range(5, 16))  # 11 tokens: 2 full chunks of 4


def lp(token: int, value: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token, value, ((token, value), *top))


# --- the comparator -----------------------------------------------------------------------


def test_equal_runs_match() -> None:
    run = Run([1, 2, 3], [lp(1, -0.1), lp(2, -0.2), lp(3, -0.3)])
    assert compare(run, run, 0.5).outcome == MATCH


def test_a_flip_at_a_near_tie_is_not_a_divergence() -> None:
    stored = Run([1, 7, 3], [lp(1, -0.1), lp(7, -0.69), lp(3, -0.3)])
    cold = Run([1, 2, 4], [lp(1, -0.1), lp(2, -0.68, (7, -0.71)), lp(4, -0.3)])
    v = compare(stored, cold, 0.5)
    assert (v.outcome, v.position, v.gap_is_bound) == (NEAR_TIE, 1, False)
    assert v.gap == pytest.approx(0.03)


def test_a_flip_beyond_the_tolerance_is_a_divergence() -> None:
    stored = Run([9], [lp(9, -0.01)])
    cold = Run([2], [lp(2, -0.05, (5, -1.0), (9, -3.05))])
    v = compare(stored, cold, 0.5)
    assert (v.outcome, v.position, v.gap) == (DIVERGENT, 0, pytest.approx(3.0))


def test_a_stored_token_outside_the_cold_top_gives_a_lower_bound() -> None:
    stored = Run([1, 9], [lp(1, -0.1), lp(9, -0.01)])
    cold = Run([1, 2], [lp(1, -0.1), lp(2, -0.05, (5, -2.05))])
    v = compare(stored, cold, 0.5)
    assert (v.outcome, v.position, v.gap_is_bound) == (DIVERGENT, 1, True)
    assert v.gap == pytest.approx(2.0)
    no_top = compare(stored, Run([1, 2], [lp(1, -0.1)]), 0.5)
    assert (no_top.outcome, no_top.gap) == (DIVERGENT, math.inf)


# --- the SLO window -----------------------------------------------------------------------


def test_the_window_breaches_only_with_enough_checks_above_the_rate() -> None:
    w = DivergenceWindow(window=4, min_checks=3, max_divergence=0.25)
    assert w.record("a", True) == 1.0
    assert not w.breached("a")  # one check is not enough
    w.record("a", False)
    w.record("a", False)
    assert w.rate("a") == pytest.approx(1 / 3) and w.breached("a")
    w.record("a", False)
    assert not w.breached("a")  # 1 of 4 = 0.25, not above
    w.record("a", False)  # the divergent one leaves the window
    assert w.rate("a") == 0.0 and not w.breached("b")
    assert "0 of the last 4 checks diverged" in w.evidence("a")


# --- the check against a scripted worker --------------------------------------------------


class Call(DecodeCall):
    def __init__(self, messages: list[engine_pb2.DecodeResponse], fail: bool) -> None:
        self.messages = messages
        self.fail = fail
        self.cancelled = False

    async def _gen(self):
        if self.fail:
            raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, "fake worker down")
        for m in self.messages:
            await asyncio.sleep(0)
            yield m

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> None:
        self.cancelled = True


def answer(tokens: list[int], top: list[list[tuple[int, float]]], loaded: int, cached: int = 0):
    """Two messages: all tokens but the last, then the last with the prompt counts."""
    out = []
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        lps = common_pb2.OutputLogProbs(token_ids=[t], token_logprobs=[top[i][0][1]])
        lps.top_logprobs.append(
            common_pb2.TopLogProbs(token_ids=[a for a, _ in top[i]], values=[b for _, b in top[i]])
        )
        out.append(
            engine_pb2.DecodeResponse(
                token_ids=[t],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                loaded_tokens=loaded if last else 0,
                prefix_cached_tokens=cached if last else 0,
                recomputed_tokens=len(PROMPT) - loaded - cached if last else 0,
                logprobs=lps,
            )
        )
    return out


@dataclass
class Worker(WorkerClient):
    """A decode worker whose stored run answers ``stored`` and cold run ``cold``."""

    stored: list[int] = field(default_factory=lambda: [1, 2])
    cold: list[int] = field(default_factory=lambda: [1, 2])
    loaded: int = 8
    fail: bool = False
    requests: list[tuple[str, engine_pb2.DecodeRequest]] = field(default_factory=list)

    async def prefill(self, worker, request, timeout):
        raise AssertionError("the check never prefills")

    def decode(self, worker, request, timeout):
        self.requests.append((worker.id, request))
        cold = request.bypass_store
        tokens = self.cold if cold else self.stored
        # the cold run ranks its token at -0.1 and the other run's at -3.1: a clear flip
        other = self.stored if cold else self.cold
        top = [
            [(t, -0.1)] + ([(o, -3.1)] if o != t else [])
            for t, o in zip(tokens, other, strict=True)
        ]
        return Call(answer(tokens, top, 0 if cold else self.loaded), self.fail)


def pool(*ids: str) -> WorkerPool:
    p = WorkerPool(model="tiny")
    p.add_static(DECODE, list(ids))
    return p


def checker(worker: Worker, quarantines: list, **settings) -> kc.KVCheck:
    return kc.KVCheck(
        kc.KVCheckSettings(**{"share": 1.0, "tokens": 2, "min_checks": 2, **settings}),
        model="tiny",
        client=worker,
        pool=pool("d0", "d1"),
        set_quarantine=lambda fp, reason: quarantines.append((fp, reason)),
    )


def sample(worker: str = "decode@d1", salt: str = "tenant-salt") -> kc.Sample:
    return kc.Sample("req-1", PROMPT, salt, FP_HEX, worker)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_honest_runs_match_on_the_serving_worker_and_the_cold_run_bypasses_the_store() -> None:
    w = Worker()
    check = checker(w, [])
    before = metric("pdserve_router_kv_checks_total", outcome=MATCH, fingerprint=FP_HEX)
    result = asyncio.run(check.check(sample()))
    assert (result.outcome, result.worker) == (MATCH, "decode@d1")
    (_, stored), (worker, cold) = w.requests
    assert worker == "decode@d1"
    assert stored.cache_salt == "tenant-salt" and not stored.bypass_store
    assert cold.bypass_store and cold.cache_salt not in ("", "tenant-salt")
    assert not stored.HasField("kv") and not cold.HasField("kv")  # the worker prefills both
    for r in (stored, cold):
        assert r.sampling.temperature == 0.0 and r.sampling.max_tokens == 2
        assert r.sampling.ignore_eos and r.sampling.logprobs == 20
        assert r.prompt_token_ids == PROMPT and r.request_id.startswith("kvcheck-req-1-")
    after = metric("pdserve_router_kv_checks_total", outcome=MATCH, fingerprint=FP_HEX)
    assert after == before + 1
    assert metric("pdserve_router_kv_check_divergence_rate", fingerprint=FP_HEX) == 0.0


def test_a_stored_run_that_reused_nothing_is_no_evidence() -> None:
    w = Worker(loaded=0)
    check = checker(w, [])
    result = asyncio.run(check.check(sample()))
    assert result.outcome == kc.NO_REUSE and len(w.requests) == 1  # no cold run
    assert FP_HEX not in check.window.verdicts


def test_failed_runs_and_missing_workers_are_counted_not_judged() -> None:
    check = checker(Worker(fail=True), [])
    assert asyncio.run(check.check(sample())).outcome == kc.ERROR
    check.pool = pool()
    assert asyncio.run(check.check(sample())).outcome == kc.NO_WORKER
    assert FP_HEX not in check.window.verdicts


def test_divergence_quarantines_the_fingerprint_once_the_slo_is_breached() -> None:
    w = Worker(stored=[1, 9], cold=[1, 2])
    quarantines: list[tuple[str, str]] = []
    check = checker(w, quarantines)
    gaps = metric("pdserve_router_kv_check_logit_gap_nats_count")
    first = asyncio.run(check.check(sample()))
    assert first.verdict is not None
    assert (first.outcome, first.verdict.position) == (DIVERGENT, 1)
    assert first.verdict.gap == pytest.approx(3.0)
    assert quarantines == [] and not check.quarantined(FP_HEX)  # below kv_check_min
    asyncio.run(check.check(sample()))
    assert metric("pdserve_router_kv_check_logit_gap_nats_count") == gaps + 2
    assert metric("pdserve_router_kv_check_divergence_rate", fingerprint=FP_HEX) == 1.0
    assert [fp for fp, _ in quarantines] == [FP_HEX]
    assert "2 of the last 2 checks diverged" in quarantines[0][1]
    assert check.quarantined(FP_HEX)
    assert metric("pdserve_router_kv_quarantined", fingerprint=FP_HEX) == 1.0
    asyncio.run(check.check(sample()))
    assert len(quarantines) == 1  # once

    # while quarantined: the fingerprint's requests run under a rotated salt, per tenant salt
    req = GenRequest("r", PROMPT, Sampling(), cache_salt="a")
    routed = check.route(req, FP_HEX)
    assert routed.cache_salt not in ("a", "") and len(routed.cache_salt) == 64
    assert check.route(req, FP_HEX).cache_salt == routed.cache_salt
    assert check.cache_salt(FP_HEX, "b") != routed.cache_salt
    assert check.route(req, "another") is req

    check.lift(FP_HEX)
    assert not check.quarantined(FP_HEX) and FP_HEX not in check.window.verdicts
    assert check.route(req, FP_HEX).cache_salt == routed.cache_salt  # prefix caches may be bad


def test_a_failed_master_call_leaves_the_routers_own_quarantine() -> None:
    def refuse(fp: str, reason: str) -> None:
        raise RuntimeError("master unreachable")

    check = checker(Worker(stored=[1, 9], cold=[1, 2]), [], min_checks=1)
    check.set_quarantine = refuse
    asyncio.run(check.check(sample()))
    assert check.quarantined(FP_HEX)


# --- the sampler --------------------------------------------------------------------------


def served(decode_loaded: int = 0, prefill_cached: int = 0) -> Trace:
    t = Trace(Plan.READ, decode_worker="decode@d0")
    t.decode_loaded, t.prefill_cached = decode_loaded, prefill_cached
    return t


def test_only_requests_served_from_the_store_are_sampled_at_the_share() -> None:
    draws = iter([0.3, 0.7, 0.1])
    check = checker(Worker(), [], share=0.5)
    check.rng = lambda: next(draws)
    req = GenRequest("r", PROMPT, Sampling())
    assert not check.offer(req, served(), FP_HEX)  # nothing loaded: no draw either
    assert check.offer(req, served(decode_loaded=8), FP_HEX)  # 0.3 < 0.5
    assert not check.offer(req, served(prefill_cached=8), FP_HEX)  # 0.7
    assert check.offer(req, served(prefill_cached=8), FP_HEX)  # 0.1
    assert not check.offer(req, served(decode_loaded=8), "")  # no fingerprint yet
    assert check.queue.qsize() == 2
    s = check.queue.get_nowait()
    assert (s.prompt, s.fingerprint, s.worker) == (PROMPT, FP_HEX, "decode@d0")


def test_a_full_queue_drops_the_sample_and_counts_it() -> None:
    check = checker(Worker(), [], queue=1)
    req = GenRequest("r", PROMPT, Sampling())
    dropped = metric("pdserve_router_kv_checks_dropped_total", reason="queue_full")
    assert check.offer(req, served(decode_loaded=8), FP_HEX)
    assert not check.offer(req, served(decode_loaded=8), FP_HEX)
    assert metric("pdserve_router_kv_checks_dropped_total", reason="queue_full") == dropped + 1


def test_the_loop_checks_queued_samples_until_stopped() -> None:
    check = checker(Worker(), [])

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(check.run(stop))
        check.offer(GenRequest("r", PROMPT, Sampling()), served(decode_loaded=8), FP_HEX)
        while not check.results:
            await asyncio.sleep(0.001)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert [r.outcome for r in check.results] == [MATCH]


# --- the orchestrator's side --------------------------------------------------------------


@dataclass
class LocalWorker(WorkerClient):
    """Serves the local plan: 2 tokens, 8 prompt tokens loaded from the store."""

    requests: list[engine_pb2.DecodeRequest] = field(default_factory=list)

    async def prefill(self, worker, request, timeout):
        raise AssertionError("local plan only")

    def decode(self, worker, request, timeout):
        self.requests.append(request)
        return Call(answer([1, 2], [[(1, -0.1)], [(2, -0.1)]], 8), False)


def test_the_orchestrator_offers_requests_and_honours_a_quarantine() -> None:
    client = LocalWorker()
    p = WorkerPool(model="tiny")
    p.add_static(DECODE, ["d0"])
    lookups: list[list[str]] = []
    held = [2]  # chunks the store answers it holds

    async def lookup(keys: list[str]) -> int:
        lookups.append(keys)
        return held[0]

    check = kc.KVCheck(
        kc.KVCheckSettings(share=1.0), model="tiny", client=client, pool=p, rng=lambda: 0.0
    )
    orch = Orchestrator(
        OrchestratorConfig(model="tiny", default_mode="colocated"),
        client=client,
        fingerprints=FingerprintSource.fixed(FP),
        pool=p,
        policy=RoundRobin(),
        admission=Admission(4, 4),
        prefix_lookup=lookup,
        kv_check=check,
    )
    req = GenRequest("rq", PROMPT, Sampling(max_tokens=2, temperature=0.0), cache_salt="s")

    async def generate() -> list[int]:
        return [t async for c in orch.generate(req) for t in c.token_ids]

    ok = metric("pdserve_router_requests_total", plan="local", outcome="ok")
    assert asyncio.run(generate()) == [1, 2]
    assert check.queue.qsize() == 1 and client.requests[-1].cache_salt == "s"
    assert len(lookups) == 1
    asyncio.run(check.check(check.queue.get_nowait()))  # stored + cold: no client traffic
    assert metric("pdserve_router_requests_total", plan="local", outcome="ok") == ok + 1

    check.quarantines[FP_HEX] = "test"
    check.rotations[FP_HEX] = b"k" * 16
    held[0] = 0  # the master answers the fingerprint's objects as not found
    assert asyncio.run(generate()) == [1, 2]
    rotated = check.cache_salt(FP_HEX, "s")
    assert client.requests[-1].cache_salt == rotated != "s"
    assert lookups[-1] == chunk_keys(FP, PROMPT, rotated)
    assert check.quarantined(FP_HEX)

    held[0] = 1  # a hit on the rotated keys: an operator cleared the quarantine
    assert asyncio.run(orch.cached_tokens(PROMPT, rotated))[1] == 4
    assert not check.quarantined(FP_HEX)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_check_share", 1.5, "kv_check_share must be in [0, 1]"),
        ("kv_check_tokens", 0, "kv_check_tokens must be in [1, 64]"),
        ("kv_check_tolerance", -0.1, "kv_check_tolerance must be >= 0"),
        ("kv_check_min", 21, "kv_check_min (21) must be in [1, kv_check_window (20)]"),
        ("kv_check_max_divergence", 1.0, "kv_check_max_divergence must be in [0, 1)"),
        ("kv_check_queue", 0, "kv_check_queue must be >= 1"),
    ],
)
def test_the_config_refuses_check_settings_that_cannot_work(field, value, message) -> None:
    cfg = RouterConfig(decode=["127.0.0.1:1"], **{field: value})
    with pytest.raises(ConfigError) as exc:
        cfg.validate()
    assert message in str(exc.value)
    assert RouterConfig(decode=["127.0.0.1:1"]).kv_check_settings() == kc.KVCheckSettings()
