"""Orchestration through a real in-process router (gRPC) against fake Prefill/Decode workers:
plans, retries, circuit breaker, cancellation, deadlines and admission."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill, expected_tokens, fake_cluster

from pdserve import grpcutil
from pdserve.services.router.plan import Plan
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 11 tokens: 2 full chunks of 4 + 3


def gen_req(n=6, mode=router_pb2.DISAGG_MODE_UNSPECIFIED, prompt=PROMPT, **kw):
    return router_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0),
        mode=mode,
        **kw,
    )


async def stream_all(port: int, req, timeout=20.0):
    async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        msgs = [m async for m in stub.GenerateStream(req, timeout=timeout)]
    return msgs


def ids(msgs):
    return [t for m in msgs for t in m.token_ids]


def run(coro):
    return asyncio.run(coro)


def test_read_mode_streams_prefill_then_decode(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(6, request_id="rq-1"))
            assert ids(msgs) == expected_tokens(PROMPT, 6)
            assert msgs[0].prompt_tokens == len(PROMPT)
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert all(m.request_id == "rq-1" for m in msgs)
            times = [t for m in msgs for t in m.token_times_ms]
            assert times == sorted(times) and len(times) == 6
            assert len(p.calls) == 1 and not p.calls[0].publish_incrementally
            (dreq,) = d.calls
            assert dreq.HasField("kv") and dreq.first_token_id == expected_tokens(PROMPT, 1)[0]
            assert r.frontend.orchestrator.traces[-1].plan == Plan.READ

    run(main())


def test_write_mode_starts_decode_before_prefill_ends(tiny_model_dir):
    async def main():
        p, d = FakePrefill(delay_s=0.4), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(5, router_pb2.DISAGG_MODE_WRITE))
            assert ids(msgs) == expected_tokens(PROMPT, 5)
            assert p.calls[0].publish_incrementally
            (dreq,) = d.calls
            # (11 - 1) // 4 = 2 full chunks to wait for; decode samples the first token itself
            assert len(dreq.kv.chunk_keys) == 2 and dreq.kv.num_tokens == 8
            assert not dreq.HasField("first_token_id") and dreq.chunk_wait_ms > 0
            fp = r.frontend.orchestrator.fp
            from pdserve.hashing import chunk_keys

            assert list(dreq.kv.chunk_keys) == chunk_keys(fp, PROMPT)[:2]
            assert await _wait_for(lambda: len(p.ends) == 1)  # prefill finishes publishing
            assert d.starts[0] < p.ends[0]

    run(main())


def test_colocated_and_no_prefill_worker_run_locally(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(4, router_pb2.DISAGG_MODE_COLOCATED))
            assert ids(msgs) == expected_tokens(PROMPT, 4)
            assert not p.calls and not d.calls[0].HasField("kv")
        d2 = FakeDecode()
        async with fake_cluster([], [d2], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(4))
            assert ids(msgs) == expected_tokens(PROMPT, 4)
            assert r.frontend.orchestrator.traces[-1].plan == Plan.LOCAL

    run(main())


def test_short_uncached_prompt_prefills_on_decode(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir, local_prefill_threshold=64) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(3))
            assert ids(msgs) == expected_tokens(PROMPT, 3)
            assert not p.calls and not d.calls[0].HasField("kv")
            long_prompt = list(range(20, 120))
            msgs = await stream_all(r.grpc_port, gen_req(3, prompt=long_prompt))
            assert ids(msgs) == expected_tokens(long_prompt, 3) and len(p.calls) == 1

    run(main())


def test_prefill_error_retries_once_on_another_worker(tiny_model_dir):
    async def main():
        a, b, d = FakePrefill(), FakePrefill(), FakeDecode()
        async with fake_cluster([a, b], [d], tiny_model_dir, policy="round_robin") as (r, servers):
            # round robin goes by worker id first: make exactly that worker fail once
            first = sorted(r.frontend.pool.workers["prefill"])[0]
            (a if first.endswith(servers[0].address) else b).fail = 1
            msgs = await stream_all(r.grpc_port, gen_req(3))
            assert ids(msgs) == expected_tokens(PROMPT, 3)
            trace = r.frontend.orchestrator.traces[-1]
            assert len(trace.retries) == 1 and len(a.calls) == len(b.calls) == 1
            assert d.calls[0].HasField("kv") and trace.plan == Plan.READ

    run(main())


def test_all_prefills_failing_falls_back_to_local_prefill(tiny_model_dir):
    async def main():
        a, b, d = FakePrefill(fail=9), FakePrefill(fail=9), FakeDecode()
        async with fake_cluster([a, b], [d], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(3))
            assert ids(msgs) == expected_tokens(PROMPT, 3)
            assert len(a.calls) + len(b.calls) == 2  # first try + one retry, no more
            assert not d.calls[0].HasField("kv")
            assert r.frontend.orchestrator.traces[-1].plan == Plan.READ_THEN_LOCAL

    run(main())


def test_write_mode_prefill_failing_everywhere_falls_back_to_local(tiny_model_dir):
    async def main():
        # decode's first token comes well after both prefill attempts have failed
        a, b, d = FakePrefill(fail=9), FakePrefill(fail=9), FakeDecode(token_delay_s=0.5)
        async with fake_cluster([a, b], [d], tiny_model_dir) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(3, router_pb2.DISAGG_MODE_WRITE))
            assert ids(msgs) == expected_tokens(PROMPT, 3)
            # the waiting decode is cancelled before its first token, then prefills itself
            waiting, local = d.calls
            assert waiting.HasField("kv") and not local.HasField("kv") and d.cancelled == 1
            assert r.frontend.orchestrator.traces[-1].plan == Plan.WRITE_THEN_LOCAL

    run(main())


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT], ids=lambda c: c.name
)
def test_write_mode_refused_by_decode_falls_back_to_read(tiny_model_dir, code):
    """A decode worker that cannot take a write-mode handle (UNIMPLEMENTED; one predating
    write mode said INVALID_ARGUMENT) is a worker limitation, never the caller's error: the
    request is decoded with the answer of the prefill already running, as in the read plan."""

    async def main():
        p, d = FakePrefill(delay_s=0.2), FakeDecode(refuse_write=code)
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            for _ in range(2):
                msgs = await stream_all(r.grpc_port, gen_req(5, router_pb2.DISAGG_MODE_WRITE))
                assert ids(msgs) == expected_tokens(PROMPT, 5)
                assert r.frontend.orchestrator.traces[-1].plan == Plan.WRITE_THEN_READ
            write, read = d.calls[:2]
            assert write.HasField("kv") and not write.HasField("first_token_id")
            assert read.first_token_id == expected_tokens(PROMPT, 1)[0]
            # one prefill per request serves the fallback; the refusal counts against nothing
            assert len(p.calls) == 2 and all(c.publish_incrementally for c in p.calls)
            assert not any(w.broken for w in r.frontend.pool.workers["decode"].values())

    run(main())


def test_write_mode_invalid_request_keeps_the_callers_status(tiny_model_dir):
    async def main():
        bad = grpc.StatusCode.INVALID_ARGUMENT
        p, d = FakePrefill(fail=9, fail_code=bad), FakeDecode(fail=9, fail_code=bad)
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream_all(r.grpc_port, gen_req(3, router_pb2.DISAGG_MODE_WRITE))
            assert err.value.code() == bad

    run(main())


def test_invalid_argument_from_worker_is_not_retried(tiny_model_dir):
    async def main():
        a = FakePrefill(fail=1, fail_code=grpc.StatusCode.INVALID_ARGUMENT)
        b, d = FakePrefill(fail=1, fail_code=grpc.StatusCode.INVALID_ARGUMENT), FakeDecode()
        async with fake_cluster([a, b], [d], tiny_model_dir, policy="round_robin") as (r, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream_all(r.grpc_port, gen_req(3))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(a.calls) + len(b.calls) == 1 and not d.calls

    run(main())


def test_circuit_breaker_takes_worker_out_and_puts_it_back(tiny_model_dir):
    async def main():
        bad, good, d = FakePrefill(fail=1000), FakePrefill(), FakeDecode()
        async with fake_cluster(
            [bad, good],
            [d],
            tiny_model_dir,
            policy="round_robin",
            breaker_failures=2,
            breaker_cooldown_s=0.3,
        ) as (r, _):
            for _ in range(6):
                msgs = await stream_all(r.grpc_port, gen_req(2))
                assert ids(msgs) == expected_tokens(PROMPT, 2)
            assert len(bad.calls) == 2  # out of rotation after its 2nd failure
            (w,) = [w for w in r.frontend.pool.workers["prefill"].values() if w.broken]
            bad.fail = 0  # it recovers; the probe (health SERVING) puts it back
            deadline = time.monotonic() + 5
            while w.broken and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not w.broken
            for _ in range(4):
                await stream_all(r.grpc_port, gen_req(2))
            assert len(bad.calls) == 4

    run(main())


def test_decode_failure_before_first_token_retries_elsewhere(tiny_model_dir):
    async def main():
        p, d1, d2 = FakePrefill(), FakeDecode(), FakeDecode()
        async with fake_cluster([p], [d1, d2], tiny_model_dir) as (r, servers):
            first = sorted(r.frontend.pool.workers["decode"])[0]  # the idle tie-break
            (d1 if first.endswith(servers[1].address) else d2).fail = 1
            msgs = await stream_all(r.grpc_port, gen_req(3))
            assert ids(msgs) == expected_tokens(PROMPT, 3)
            assert len(d1.calls) == len(d2.calls) == 1
            assert r.frontend.orchestrator.traces[-1].retries

    run(main())


def test_decode_dying_mid_stream_resumes_on_another_worker(tiny_model_dir):
    async def main():
        p, d1, d2 = FakePrefill(), FakeDecode(), FakeDecode()
        async with fake_cluster([p], [d1, d2], tiny_model_dir) as (r, servers):
            first = sorted(r.frontend.pool.workers["decode"])[0]  # the idle tie-break
            dying, other = (d1, d2) if first.endswith(servers[1].address) else (d2, d1)
            dying.fail_after = 4
            msgs = await stream_all(r.grpc_port, gen_req(10))
            # the client sees one uninterrupted, correct stream
            assert ids(msgs) == expected_tokens(PROMPT, 10)
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            # the survivor continued from prompt + the 4 streamed tokens, for the 6 left
            (resumed,) = other.calls
            assert list(resumed.prompt_token_ids) == [*PROMPT, *expected_tokens(PROMPT, 4)]
            assert resumed.sampling.max_tokens == 6 and not resumed.HasField("kv")
            assert r.frontend.orchestrator.traces[-1].retries[0].startswith("decode-resume:")

    run(main())


async def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def test_client_cancel_reaches_the_decode_worker(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode(token_delay_s=0.05)
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            async with grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch:
                call = router_pb2_grpc.RouterServiceStub(ch).GenerateStream(gen_req(200))
                got = 0
                async for _m in call:
                    got += 1
                    if got == 3:
                        break
                assert d.active == 1
                call.cancel()
                assert await _wait_for(lambda: d.active == 0)
            assert d.cancelled == 1
            assert r.frontend.orchestrator.admission.inflight == 0

    run(main())


def test_deadline_reaches_the_decode_worker(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode(token_delay_s=0.05)
        async with fake_cluster([p], [d], tiny_model_dir) as (r, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream_all(r.grpc_port, gen_req(200), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await _wait_for(lambda: d.active == 0)
            assert d.cancelled == 1

    run(main())


def test_queue_full_is_resource_exhausted_with_reason(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode(token_delay_s=0.05)
        async with (
            fake_cluster([p], [d], tiny_model_dir, max_inflight=1, max_queue=0) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            first = stub.GenerateStream(gen_req(20))
            await first.read()  # admitted and streaming
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(gen_req(2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in err.value.details()
            first.cancel()

    run(main())


def test_generate_unary_and_list_models_and_tokenize(tiny_model_dir):
    async def main():
        p, d = FakePrefill(), FakeDecode()
        async with (
            fake_cluster([p], [d], tiny_model_dir) as (r, _),
            grpcutil.channel(f"127.0.0.1:{r.grpc_port}") as ch,
        ):
            stub = router_pb2_grpc.RouterServiceStub(ch)
            out = await stub.Generate(gen_req(4))
            want = expected_tokens(PROMPT, 4)
            assert list(out.token_ids) == want
            assert out.text == "".join(f"<{t}>" for t in want)
            assert out.prompt_tokens == len(PROMPT) and out.total_ms >= out.ttft_ms > 0
            models = await stub.ListModels(router_pb2.ListModelsRequest())
            (m,) = models.models
            assert m.name == "tiny" and m.prefill_workers == 1 and m.decode_workers == 1
            tok = await stub.Tokenize(router_pb2.TokenizeRequest(text="hello world"))
            assert len(tok.token_ids) == len(tok.tokens) > 0
            assert "".join(tok.tokens) == "hello world"

    run(main())


def test_ttft_slo_rejects_early_once_the_cluster_is_seen_to_be_slow(tiny_model_dir):
    async def main():
        p, d = FakePrefill(delay_s=0.3), FakeDecode()
        async with fake_cluster([p], [d], tiny_model_dir, slo_ttft_ms=100) as (r, _):
            msgs = await stream_all(r.grpc_port, gen_req(2))  # no estimate yet: admitted
            assert ids(msgs) == expected_tokens(PROMPT, 2)
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream_all(r.grpc_port, gen_req(2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "exceeds the SLO of 100 ms" in err.value.details()
            assert time.monotonic() - t0 < 0.3 and len(p.calls) == 1  # refused, not queued

    run(main())
