"""The KV check: the router samples requests served from the store and has a worker recompute
their prompt cold, off the client's path, to catch chunks stored under a fingerprint that does
not describe them (a model update the fingerprint missed, a bug), which are otherwise served
silently.

- :meth:`KVCheck.offer` (the orchestrator, when a request ended well): a request whose prompt
  KV came partly from the store (prefill's cached tokens, or the decode worker's loaded
  tokens) is sampled with probability ``share`` into a bounded queue; a full queue drops the
  sample (counted), never the request, and nothing waits on the check.
- :meth:`KVCheck.run` (a background task): one check at a time. A pdserve decode worker (the
  one that served the request while it is in rotation) runs the prompt twice, greedy,
  ``tokens`` tokens with their top logprobs: the *stored* run as the request ran (its cache
  salt: the store's chunks, or the worker's prefix cache that a load filled) and the *cold*
  run under a fresh random cache salt (neither the store nor vLLM's prefix cache has it) with
  ``bypass_store`` (nothing written). A stored run that reused nothing is no evidence
  (``no_reuse``). :func:`~.kv_compare.compare` gives the verdict; the fingerprint's window
  (:class:`~.kv_compare.DivergenceWindow`) decides the SLO.
- A breach quarantines the fingerprint: the master's ``SetQuarantine`` (its objects then
  answer as not found, so workers recompute), an error log with the evidence, and in the
  router itself: no store hits counted for it in placement (:meth:`quarantined`), and every
  request of it runs under a rotated cache salt (:meth:`cache_salt`), because the workers'
  own prefix caches (vLLM's) still hold blocks that the bad chunks filled.

Check requests are no client traffic: they bypass the orchestrator, so the request metrics
(``trace.py``) never see them; their own metrics are below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from pdserve.requests import MAX_LOGPROBS, Sampling
from pdserve.requests_codec import logprobs_from_proto, sampling_to_proto
from pdserve.services.router.kv_compare import (
    DIVERGENT,
    MATCH,
    NEAR_TIE,
    DivergenceWindow,
    Run,
    Verdict,
    compare,
)
from pdserve.services.router.request import GenRequest
from pdserve.services.router.trace import Trace
from pdserve.services.router.worker_client import WorkerCallError, WorkerClient
from pdserve.services.router.workers import DECODE, Worker, WorkerPool
from pdserve.telemetry import REGISTRY, init_labels
from pdserve.v1 import engine_pb2

log = logging.getLogger(__name__)

#: Outcomes besides the verdicts: the stored run reused no KV; no pdserve decode worker was in
#: rotation; a run failed.
NO_REUSE = "no_reuse"
NO_WORKER = "no_worker"
ERROR = "error"

CHECKS = Counter(
    "pdserve_router_kv_checks",
    "KV checks by outcome (match, near_tie, divergent, no_reuse, no_worker, error) and "
    "fingerprint (digest hex)",
    ["outcome", "fingerprint"],
    registry=REGISTRY,
)
DROPPED = init_labels(
    Counter(
        "pdserve_router_kv_checks_dropped",
        "Sampled KV checks dropped: queue_full (the bounded queue was full)",
        ["reason"],
        registry=REGISTRY,
    ),
    ("queue_full",),
)
DIVERGENCE = Gauge(
    "pdserve_router_kv_check_divergence_rate",
    "Share of divergent verdicts over a fingerprint's last kv_check_window checks",
    ["fingerprint"],
    registry=REGISTRY,
)
POSITION = Histogram(
    "pdserve_router_kv_check_first_diff_position",
    "Index of the first generated token where the stored and the cold run differ (flips only)",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
    registry=REGISTRY,
)
GAP = Histogram(
    "pdserve_router_kv_check_logit_gap_nats",
    "Logit gap at the first differing token: the cold run's logprob of its own token minus "
    "its logprob of the stored run's token (nats; flips only)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
    registry=REGISTRY,
)
SECONDS = Histogram(
    "pdserve_router_kv_check_seconds",
    "Wall time of one KV check, both runs (seconds)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
QUARANTINED = Gauge(
    "pdserve_router_kv_quarantined",
    "1 while the router holds a fingerprint quarantined by the KV check",
    ["fingerprint"],
    registry=REGISTRY,
)

#: One run's time limit (seconds): a check never holds a worker slot longer.
RUN_TIMEOUT_S = 120.0

#: ``fingerprint hex, reason`` -> the master quarantines it (blocking; run off the loop).
SetQuarantine = Callable[[str, str], None]


class MasterQuarantine:
    """:data:`SetQuarantine` through pdserve's store client (``set_quarantine``), opened on
    first use: most routers never quarantine anything."""

    def __init__(self, master: str) -> None:
        self.master = master
        self._client: Any = None

    def __call__(self, fingerprint: str, reason: str) -> None:
        if self._client is None:
            from pdserve.store import open_store

            self._client = open_store(self.master, control="grpc")
        self._client.set_quarantine(fingerprint, reason)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclasses.dataclass(frozen=True)
class KVCheckSettings:
    """The check's knobs (RouterConfig's ``kv_check_*``)."""

    share: float = 0.01
    tokens: int = 4
    tolerance: float = 0.5
    window: int = 20
    min_checks: int = 3
    max_divergence: float = 0.05
    queue: int = 16


@dataclasses.dataclass(frozen=True)
class Sample:
    """A request picked for a check."""

    request_id: str
    prompt: list[int]
    #: The cache salt the request ran under (tenant-namespaced, rotated when quarantined).
    cache_salt: str
    #: Digest hex of the fingerprint it was served under.
    fingerprint: str
    #: The decode worker that served it ("" = unknown).
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class CheckResult:
    sample: Sample
    outcome: str
    verdict: Verdict | None = None
    worker: str = ""
    stored: Run | None = None
    cold: Run | None = None


class KVCheck:
    """See the module docstring. ``set_quarantine``: the master's (None: a store without
    quarantines, Mooncake's; the router quarantines in its own placement only); ``rng``: a
    number in [0, 1) per offer."""

    def __init__(
        self,
        settings: KVCheckSettings,
        *,
        model: str,
        client: WorkerClient,
        pool: WorkerPool,
        set_quarantine: SetQuarantine | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.model = model
        self.client = client
        self.pool = pool
        self.set_quarantine = set_quarantine
        self.rng = rng
        self.queue: asyncio.Queue[Sample] = asyncio.Queue(settings.queue)
        self.window = DivergenceWindow(
            settings.window, settings.min_checks, settings.max_divergence
        )
        #: Fingerprints quarantined by this router (digest hex -> why).
        self.quarantines: dict[str, str] = {}
        #: Digest hex -> the key of its requests' rotated cache salts (:meth:`cache_salt`),
        #: from its first quarantine on: kept when a quarantine is lifted, since the workers'
        #: prefix caches may still hold blocks the bad chunks filled.
        self.rotations: dict[str, bytes] = {}
        #: Recent results (tests, logs).
        self.results: deque[CheckResult] = deque(maxlen=256)

    # --- the orchestrator's side ------------------------------------------------------------

    def quarantined(self, fingerprint: str) -> bool:
        return fingerprint in self.quarantines

    def store_hits(self, fingerprint: str, found: int) -> int:
        """The chunks of a lookup that placement may count: ``found``, or none while the
        fingerprint is quarantined. A quarantined fingerprint's objects answer as not found
        and its puts are refused, so a hit on its (rotated) keys means an operator cleared the
        quarantine at the master: the router then lifts its own (:meth:`lift`)."""
        if fingerprint not in self.quarantines:
            return found
        if found:
            log.info(
                "KV check: the store serves fingerprint %s again: quarantine lifted", fingerprint
            )
            self.lift(fingerprint)
        return found

    def cache_salt(self, fingerprint: str, salt: str) -> str:
        """The cache salt a request of ``fingerprint`` runs under: ``salt``, or once the
        fingerprint was quarantined a salt derived from it and the quarantine's random key
        (hex; so still the tenant's own namespace), whose chunk keys and prefix-cache blocks
        no bad chunk ever filled."""
        key = self.rotations.get(fingerprint)
        if key is None:
            return salt
        mixed = hashlib.blake2b(salt.encode(), key=key, person=b"pdserve-kvq", digest_size=32)
        return mixed.hexdigest()

    def route(self, req: GenRequest, fingerprint: str) -> GenRequest:
        """``req`` as it runs: under :meth:`cache_salt`."""
        salt = self.cache_salt(fingerprint, req.cache_salt)
        return req if salt == req.cache_salt else dataclasses.replace(req, cache_salt=salt)

    def offer(self, req: GenRequest, trace: Trace, fingerprint: str) -> bool:
        """Samples a finished request (the orchestrator's, ``req`` as it ran): True when it
        was queued for a check. Only requests whose prompt KV came partly from the store, and
        ``share`` of them; a full queue drops the sample (counted). Never blocks or raises."""
        if not fingerprint or not (trace.prefill_cached or trace.decode_loaded):
            return False
        if self.rng() >= self.settings.share:
            return False
        sample = Sample(
            req.request_id,
            list(req.prompt_token_ids),
            req.cache_salt,
            fingerprint,
            trace.decode_worker,
        )
        try:
            self.queue.put_nowait(sample)
        except asyncio.QueueFull:
            DROPPED.labels("queue_full").inc()
            return False
        return True

    # --- the background side ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Checks queued samples one at a time until ``stop`` is set (or cancelled)."""
        while not stop.is_set():
            get = asyncio.ensure_future(self.queue.get())
            halt = asyncio.ensure_future(stop.wait())
            try:
                done, _ = await asyncio.wait({get, halt}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # stopped, or cancelled: neither waiter outlives the loop
                halt.cancel()
                if not get.done():
                    get.cancel()
            if get not in done:
                return
            try:
                await self.check(get.result())
            except Exception:  # a check must never end the loop
                log.exception("KV check failed")

    async def check(self, sample: Sample) -> CheckResult:
        """Runs one check and acts on it (metrics, window, quarantine)."""
        t0 = time.monotonic()
        result = await self._check(sample)
        SECONDS.observe(time.monotonic() - t0)
        self.results.append(result)
        fp = sample.fingerprint
        CHECKS.labels(result.outcome, fp).inc()
        verdict = result.verdict
        if verdict is None:
            if result.outcome == ERROR:
                log.warning("KV check of request %s: a run failed", sample.request_id)
            return result
        if verdict.outcome != MATCH:
            POSITION.observe(verdict.position)
            GAP.observe(verdict.gap)
        if verdict.outcome != MATCH:
            # a near tie is logged too (info): the gaps honest flips reach set the tolerance
            log.log(
                logging.WARNING if verdict.outcome == DIVERGENT else logging.INFO,
                "KV check of request %s (fingerprint %s) on %s: %s at token %d, logit gap "
                "%.3f nats%s (tolerance %.3f); stored %s, cold %s",
                sample.request_id,
                fp,
                result.worker,
                verdict.outcome,
                verdict.position,
                verdict.gap,
                " at least" if verdict.gap_is_bound else "",
                self.settings.tolerance,
                result.stored.tokens if result.stored else [],
                result.cold.tokens if result.cold else [],
            )
        DIVERGENCE.labels(fp).set(self.window.record(fp, verdict.outcome == DIVERGENT))
        if self.window.breached(fp) and fp not in self.quarantines:
            await self._quarantine(fp)
        return result

    async def _check(self, sample: Sample) -> CheckResult:
        w = self._worker(sample.worker)
        if w is None:
            return CheckResult(sample, NO_WORKER)
        try:
            stored = await self._generate(w, sample, sample.cache_salt, bypass=False)
            if not (stored.loaded_tokens or stored.prefix_cached_tokens):
                return CheckResult(sample, NO_REUSE, worker=w.id, stored=stored)
            cold = await self._generate(w, sample, secrets.token_hex(16), bypass=True)
        except WorkerCallError as exc:
            log.warning("KV check on %s: %s %s", w.id, exc.code.name, exc.details)
            return CheckResult(sample, ERROR, worker=w.id)
        verdict = compare(stored, cold, self.settings.tolerance)
        assert verdict.outcome in (MATCH, NEAR_TIE, DIVERGENT)
        return CheckResult(sample, verdict.outcome, verdict, w.id, stored, cold)

    def _worker(self, preferred: str) -> Worker | None:
        """The decode worker of the check: the one that served the request while it is in
        rotation (its prefix cache holds what the request used), else the least busy
        pdserve worker. Stock engines (``http://``) are skipped: they return no logprobs."""
        cands = [w for w in self.pool.candidates(DECODE) if not w.http]
        for w in cands:
            if w.id == preferred:
                return w
        return min(cands, key=lambda w: (w.inflight_tokens, w.inflight), default=None)

    async def _generate(self, w: Worker, sample: Sample, salt: str, *, bypass: bool) -> Run:
        """One greedy run of the sample's prompt on ``w`` (the local plan: the worker
        prefills), counted on the worker while it runs, as placement expects."""
        n = self.settings.tokens
        request = engine_pb2.DecodeRequest(
            request_id=f"kvcheck-{sample.request_id[:100]}-{'cold' if bypass else 'stored'}",
            model=self.model,
            prompt_token_ids=sample.prompt,
            sampling=sampling_to_proto(
                Sampling(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS)
            ),
            cache_salt=salt,
            bypass_store=bypass,
        )
        tokens: list[int] = []
        logprobs = []
        loaded = cached = 0
        w.inflight += 1
        w.inflight_tokens += len(sample.prompt)
        call = self.client.decode(w, request, RUN_TIMEOUT_S)
        try:
            async for resp in call:
                tokens.extend(resp.token_ids)
                if resp.HasField("logprobs"):
                    logprobs.extend(logprobs_from_proto(resp.logprobs))
                if resp.finish_reason:
                    loaded, cached = resp.loaded_tokens, resp.prefix_cached_tokens
        finally:
            w.inflight -= 1
            w.inflight_tokens -= len(sample.prompt)
            call.cancel()
        return Run(tokens, logprobs, loaded, cached)

    async def _quarantine(self, fp: str) -> None:
        """Quarantines ``fp``: in the router at once, then at the master (a failure there is
        logged; the router's own quarantine stands)."""
        reason = f"router KV check: {self.window.evidence(fp)}"
        self.quarantines[fp] = reason
        self.rotations[fp] = secrets.token_bytes(16)
        QUARANTINED.labels(fp).set(1)
        log.error(
            "KV check: quarantining fingerprint %s: %s; its chunks are no longer read from the "
            "store. Clear it with `pdserve kvstore quarantine --clear %s` once its chunks are "
            "dropped (docs/router.md, KV check)",
            fp,
            reason,
            fp,
        )
        if self.set_quarantine is None:
            return
        try:
            await asyncio.to_thread(self.set_quarantine, fp, reason)
        except Exception as exc:
            log.error("KV check: the master did not quarantine %s: %s", fp, exc)

    def lift(self, fp: str) -> None:
        """Ends the router's quarantine of ``fp`` (the operator cleared it at the master):
        store hits count again and a fresh window starts. Its requests keep their rotated
        salts (:attr:`rotations`)."""
        if self.quarantines.pop(fp, None) is not None:
            QUARANTINED.labels(fp).set(0)
            self.window.reset(fp)
            DIVERGENCE.labels(fp).set(0)
