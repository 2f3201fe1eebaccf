"""The orchestrator in-process: a fake WorkerClient instead of servers (plans, retries,
resume, placement and the accounting on the workers)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
from router_fakes import expected_tokens, next_token

from pdserve import errors
from pdserve.hashing import ModelFingerprint, chunk_keys
from pdserve.requests import Sampling
from pdserve.services.router.admission import Admission
from pdserve.services.router.fingerprint import FingerprintSource
from pdserve.services.router.orchestrator import Orchestrator, OrchestratorConfig
from pdserve.services.router.plan import Plan
from pdserve.services.router.policies import RoundRobin
from pdserve.services.router.request import GenRequest
from pdserve.services.router.worker_client import DecodeCall, WorkerCallError, WorkerClient
from pdserve.services.router.workers import DECODE, PREFILL, Worker, WorkerPool
from pdserve.v1 import common_pb2, engine_pb2

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 11 tokens: 2 full chunks of 4 + 3
FP = ModelFingerprint(model_id="tiny", revision="r", chunk_size=4)


class FakeCall(DecodeCall):
    def __init__(self, stream) -> None:
        self._stream = stream
        self.cancelled = False

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> engine_pb2.DecodeResponse:
        if self.cancelled:
            raise WorkerCallError(grpc.StatusCode.CANCELLED, "cancelled")
        return await self._stream.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeWorkers(WorkerClient):
    """The fake model of router_fakes behind in-process calls. The next decode calls fail
    with ``decode_failures`` before their first token; ``die_after`` fails the next one
    after that many tokens. A local decode reports 8 prompt tokens from its prefix cache."""

    decode_failures: list[grpc.StatusCode] = field(default_factory=list)
    die_after: int = -1
    calls: list[tuple[str, str, object]] = field(default_factory=list)
    #: (worker id, its inflight_tokens) when each decode started computing.
    decode_load: list[tuple[str, int]] = field(default_factory=list)

    async def prefill(self, worker, request, timeout):
        self.calls.append((PREFILL, worker.id, request))
        n = len(request.prompt_token_ids)
        return engine_pb2.PrefillResponse(
            first_token_id=next_token(request.prompt_token_ids[-1]),
            kv=common_pb2.KVHandle(num_tokens=n, chunk_size=4),
            computed_tokens=n,
            worker_ms=1.0,
        )

    def decode(self, worker, request, timeout):
        self.calls.append((DECODE, worker.id, request))
        return FakeCall(self._stream(worker, request))

    async def _stream(self, worker: Worker, request: engine_pb2.DecodeRequest):
        self.decode_load.append((worker.id, worker.inflight_tokens))
        if self.decode_failures:
            raise WorkerCallError(self.decode_failures.pop(0), "fake decode failure")
        die, self.die_after = self.die_after, -1
        n = request.sampling.max_tokens
        if request.HasField("first_token_id"):
            toks = [request.first_token_id, *expected_tokens([request.first_token_id], n - 1)]
        else:
            toks = expected_tokens(list(request.prompt_token_ids), n)
        local = not request.HasField("kv")
        for i, t in enumerate(toks):
            if i == die:
                raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, "fake decode died")
            await asyncio.sleep(0)
            last = i == len(toks) - 1  # the prompt counts come with it (DecodeResponse)
            yield engine_pb2.DecodeResponse(
                token_ids=[t],
                text=f"<{t}>",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                token_times_ms=[float(i)],
                prefix_cached_tokens=8 if local and last else 0,
                recomputed_tokens=len(request.prompt_token_ids) - 8 if local and last else 0,
            )


def orchestrator(
    client: WorkerClient, prefill: int = 1, decode: int = 2, prefix_lookup=None, **cfg
) -> Orchestrator:
    pool = WorkerPool(model="tiny")
    pool.add_static(PREFILL, [f"p{i}" for i in range(prefill)])
    pool.add_static(DECODE, [f"d{i}" for i in range(decode)])
    return Orchestrator(
        OrchestratorConfig(model="tiny", **cfg),
        client=client,
        fingerprints=FingerprintSource.fixed(FP),
        pool=pool,
        policy=RoundRobin(),
        admission=Admission(4, 4),
        prefix_lookup=prefix_lookup,
        detokenize=lambda ids: "".join(f"<{t}>" for t in ids),
    )


def generate(orch: Orchestrator, n: int, mode: str = "", cache_salt: str = ""):
    req = GenRequest("rq", PROMPT, Sampling(max_tokens=n, temperature=0.0), mode, cache_salt)

    async def collect():
        return [c async for c in orch.generate(req)]

    return asyncio.run(collect())


def workers(orch: Orchestrator) -> list[Worker]:
    return [w for table in orch.pool.workers.values() for w in table.values()]


def test_read_plan_streams_prefill_then_decode():
    client = FakeWorkers()
    orch = orchestrator(client)
    chunks = generate(orch, 5)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 5)
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in expected_tokens(PROMPT, 5))
    assert (chunks[0].prompt_tokens, chunks[0].cached_tokens) == (len(PROMPT), 0)
    assert chunks[-1].finish == common_pb2.FINISH_REASON_LENGTH
    (kind_p, _, preq), (kind_d, _, dreq) = client.calls
    assert kind_p == PREFILL and kind_d == DECODE and not preq.publish_incrementally
    assert dreq.HasField("kv") and dreq.first_token_id == expected_tokens(PROMPT, 1)[0]
    assert orch.traces[-1].plan == Plan.READ
    assert all(w.inflight == w.inflight_tokens == 0 for w in workers(orch))


@pytest.mark.parametrize(
    ("code", "failures"),
    [(grpc.StatusCode.UNAVAILABLE, 1), (grpc.StatusCode.RESOURCE_EXHAUSTED, 0)],
)
def test_decode_failing_before_its_first_token_is_retried_on_the_other_worker(code, failures):
    client = FakeWorkers(decode_failures=[code])
    orch = orchestrator(client)
    chunks = generate(orch, 4)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 4)
    (first, second) = [wid for kind, wid, _ in client.calls if kind == DECODE]
    assert first != second and orch.traces[-1].retries == [f"decode:{second}"]
    # a busy worker (RESOURCE_EXHAUSTED) is tried elsewhere without counting against it
    assert orch.pool.workers[DECODE][first].failures == failures
    assert chunks[0].prompt_tokens == len(PROMPT)  # reported once, by the worker that answered


def test_unreachable_decode_workers_do_not_use_up_the_retry():
    """Dead workers still in rotation (UNAVAILABLE before answering) are skipped without
    spending the one retry; each is tried once, and a real failure ends it."""
    client = FakeWorkers(decode_failures=[grpc.StatusCode.UNAVAILABLE] * 2)
    orch = orchestrator(client, decode=3)
    chunks = generate(orch, 4)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 4)
    assert len({wid for kind, wid, _ in client.calls if kind == DECODE}) == 3
    client = FakeWorkers(decode_failures=[grpc.StatusCode.INTERNAL] * 2)
    orch = orchestrator(client, decode=3)
    with pytest.raises(errors.Unavailable, match="decode failed on 2 worker"):
        generate(orch, 4)


def test_decode_dying_mid_stream_resumes_from_the_streamed_tokens():
    client = FakeWorkers(die_after=3)
    orch = orchestrator(client)
    chunks = generate(orch, 8)
    want = expected_tokens(PROMPT, 8)
    assert [t for c in chunks for t in c.token_ids] == want
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in want)
    resumed = client.calls[-1][2]
    assert list(resumed.prompt_token_ids) == [*PROMPT, *want[:3]]
    assert resumed.sampling.max_tokens == 5 and not resumed.HasField("kv")
    assert orch.traces[-1].retries[0].startswith("decode-resume:")
    assert sum(c.prompt_tokens for c in chunks) == len(PROMPT)


def test_local_plan_places_on_the_worker_holding_the_prefix():
    client = FakeWorkers()
    orch = orchestrator(client, prefill=0)
    keys = chunk_keys(FP, PROMPT)
    orch.place.placement.affinity.record("decode@d1", keys)  # d1 served this prefix before
    chunks = generate(orch, 3)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)
    ((kind, wid, dreq),) = client.calls
    assert kind == DECODE and wid == "decode@d1" and not dreq.HasField("kv")
    # the prompt counted on d1 until its first token (nothing stored: all 11 tokens)
    assert client.decode_load == [("decode@d1", len(PROMPT))]
    assert all(w.inflight == w.inflight_tokens == 0 for w in workers(orch))
    # the worker's own counts (8 tokens from its prefix cache) come with its last message:
    # the client's first chunk has what the store held at routing time (nothing), the trace
    # the worker's counts; a one-token answer gets the worker's counts on its first chunk
    assert chunks[0].cached_tokens == 0 and orch.traces[-1].decode_prefix_cached == 8
    assert generate(orch, 1)[0].cached_tokens == 8
    assert orch.traces[-1].plan == Plan.LOCAL
    assert orch.place.placement.affinity.longest("decode@d1", keys) == len(keys)


def test_colocated_mode_runs_locally_even_with_prefill_workers():
    client = FakeWorkers()
    orch = orchestrator(client, default_mode="colocated")
    generate(orch, 2)
    assert [kind for kind, _, _ in client.calls] == [DECODE]
    assert orch.traces[-1].plan == Plan.LOCAL


def test_cache_salt_keys_the_lookup_the_handles_placement_and_every_worker_request():
    """Tenant A's prompt is stored: A's lookup finds it, B's (same prompt, other salt) and an
    unsalted one do not; the salt reaches prefill, decode, a resumed decode and the write
    plan's handle; placement affinity is kept per salt."""
    keys = {salt: chunk_keys(FP, PROMPT, salt) for salt in ("", "tenant-a", "tenant-b")}
    stored = set(keys["tenant-a"])
    asked: list[list[str]] = []

    async def lookup(ks: list[str]) -> int:
        asked.append(list(ks))
        return next((i for i, k in enumerate(ks) if k not in stored), len(ks))

    client = FakeWorkers()
    orch = orchestrator(client, prefix_lookup=lookup)
    for salt, cached in (("tenant-a", 8), ("tenant-b", 0), ("", 0)):
        client.calls.clear()
        chunks = generate(orch, 3, cache_salt=salt)
        assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)
        assert asked[-1] == keys[salt] and orch.traces[-1].cached_tokens == cached
        assert [(kind, req.cache_salt) for kind, _, req in client.calls] == [
            (PREFILL, salt),
            (DECODE, salt),
        ]

    client.calls.clear()
    generate(orch, 3, "write", cache_salt="tenant-b")
    ((_, _, preq), (_, _, dreq)) = sorted(client.calls, key=lambda c: c[0] == DECODE)
    assert preq.cache_salt == dreq.cache_salt == "tenant-b"
    assert list(dreq.kv.chunk_keys) == keys["tenant-b"][:2]

    client = FakeWorkers(die_after=2)
    orch = orchestrator(client, prefill=0, prefix_lookup=lookup)
    generate(orch, 6, cache_salt="tenant-a")
    first, resumed = (req for _, _, req in client.calls)
    assert first.cache_salt == resumed.cache_salt == "tenant-a" and resumed.prompt_token_ids
    affinity = orch.place.placement.affinity
    for _, wid, _ in client.calls:
        assert affinity.longest(wid, keys["tenant-a"]) == 2
        assert affinity.longest(wid, keys["tenant-b"]) == affinity.longest(wid, keys[""]) == 0
