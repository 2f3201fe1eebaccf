"""``pdserve bench serve`` metric math against a hand-computed timeline, the router's
/metrics deltas, and the streaming client against a fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fake_completions import serve_completions

from pdserve.bench.serve.metrics import (
    RequestRecord,
    completions_per_window,
    compute_metrics,
    dist_ms,
    inflight_steps,
    parse_goodput,
    parse_prometheus,
    router_figures,
)

# r0: 3 tokens in 3 chunks; r1: a single token; r2: 4 tokens in 2 chunks (one chunk carries 3
# tokens: one ITL); r3: failed.
RECORDS = [
    RequestRecord(0, 0.0, 0.85, (0.5, 0.6, 0.8), 0.8, 10, 3, 4),
    RequestRecord(1, 1.0, 1.25, (1.2,), 1.2, 20, 1, 0),
    RequestRecord(2, 2.0, 3.6, (3.0, 3.5), 3.5, 30, 4, None),
    RequestRecord(3, 2.5, 2.6, (), None, 40, 0, None, "HTTP 500: boom"),
]


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_per_request_definitions() -> None:
    r0, r1, r2, r3 = RECORDS
    assert (r0.ttft_s, r0.e2el_s, r0.tpot_s) == (approx(0.5), approx(0.8), approx(0.15))
    assert r0.itls_s == [approx(0.1), approx(0.2)]
    assert r1.tpot_s is None  # one output token: no TPOT
    assert r1.itls_s == []
    assert r2.tpot_s == approx(0.5 / 3)  # (E2EL - TTFT) / (tokens - 1)
    assert r2.itls_s == [approx(0.5)]  # a multi-token chunk is one gap
    assert not r3.success and r3.ttft_s is None and r3.itls_s == []


def test_aggregate_metrics_hand_computed() -> None:
    m = compute_metrics(RECORDS)
    assert (m.completed, m.failed) == (3, 1)
    assert m.duration_s == approx(3.6)  # first send 0.0 to last completion 3.6
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)
    assert m.request_throughput == approx(3 / 3.6)
    assert m.output_throughput == approx(8 / 3.6)
    assert m.total_token_throughput == approx(68 / 3.6)
    assert m.goodput is None and m.good_requests is None
    assert m.cached_tokens == 4

    t = m.ttft_ms  # [500, 200, 1000]
    assert (t.n, t.mean, t.median) == (3, approx(1700 / 3), approx(500.0))
    assert t.p90 == approx(900.0)  # linear: 500 + 0.8 * (1000 - 500)
    assert t.p99 == approx(990.0)
    mean = 1700 / 3
    std = math.sqrt(((200 - mean) ** 2 + (500 - mean) ** 2 + (1000 - mean) ** 2) / 3)
    assert t.std == approx(std)

    p = m.tpot_ms  # [150, 166.67]: r1 (one token) is left out
    assert (p.n, p.mean, p.median) == (2, approx((150 + 500 / 3) / 2), approx((150 + 500 / 3) / 2))
    assert p.p90 == approx(150 + 0.9 * (500 / 3 - 150))
    assert p.p99 == approx(150 + 0.99 * (500 / 3 - 150))

    i = m.itl_ms  # [100, 200, 500]
    assert (i.n, i.mean, i.median) == (3, approx(800 / 3), approx(200.0))
    assert i.p90 == approx(440.0) and i.p99 == approx(494.0)

    e = m.e2el_ms  # [800, 200, 1500]
    assert (e.n, e.mean, e.median, e.p90) == (3, approx(2500 / 3), approx(800.0), approx(1360.0))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        (["ttft:600", "tpot:160"], 2),  # r0 and r1 (TPOT of a 1-token request counts as 0)
        (["tpot:100"], 1),  # only r1
        (["e2el:1000"], 2),  # r0, r1
        (["ttft:1000"], 3),  # equal to the SLO is good
        (["ttft:100"], 0),
    ],
)
def test_goodput_counting(slos: list[str], good: int) -> None:
    m = compute_metrics(RECORDS, parse_goodput(slos))
    assert m.good_requests == good
    assert m.goodput == approx(good / 3.6)


def test_parse_goodput_rejects_bad_input() -> None:
    assert parse_goodput(["TTFT:500", "e2el:2.5"]) == {"ttft": 500.0, "e2el": 2.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_empty_sample_is_zero() -> None:
    assert dist_ms([]).n == 0 and dist_ms([]).mean == 0.0
    m = compute_metrics([RECORDS[3]])
    assert (m.completed, m.failed, m.request_throughput, m.ttft_ms.p99) == (0, 1, 0.0, 0.0)


def test_time_series() -> None:
    # completions at 0.85, 1.25, 3.6 over a 3.6 s run in 2 s windows: [0, 2) and [2, 3.6]
    assert completions_per_window(RECORDS, 2.0) == [(0.0, approx(1.0)), (2.0, approx(1 / 1.6))]
    steps = inflight_steps(RECORDS)
    assert steps[0] == (0.0, 0)
    assert [lvl for _t, lvl in steps[1:]] == [1, 0, 1, 0, 1, 2, 1, 0]
    assert max(lvl for _t, lvl in steps) == 2


BEFORE = """\
# TYPE pdserve_router_prompt_tokens counter
pdserve_router_prompt_tokens_total{source="store"} 100.0
pdserve_router_prompt_tokens_total{source="computed"} 50.0
# TYPE pdserve_router_phase_seconds histogram
pdserve_router_phase_seconds_bucket{phase="prefill",le="+Inf"} 2.0
pdserve_router_phase_seconds_count{phase="prefill"} 2.0
pdserve_router_phase_seconds_sum{phase="prefill"} 1.0
pdserve_router_phase_seconds_count{phase="decode"} 2.0
pdserve_router_phase_seconds_sum{phase="decode"} 4.0
"""
AFTER = """\
# TYPE pdserve_router_prompt_tokens counter
pdserve_router_prompt_tokens_total{source="store"} 400.0
pdserve_router_prompt_tokens_total{source="computed"} 90.0
pdserve_router_prompt_tokens_total{source="local"} 7.0
# TYPE pdserve_router_phase_seconds histogram
pdserve_router_phase_seconds_bucket{phase="prefill",le="+Inf"} 6.0
pdserve_router_phase_seconds_count{phase="prefill"} 6.0
pdserve_router_phase_seconds_sum{phase="prefill"} 3.0
pdserve_router_phase_seconds_count{phase="decode"} 2.0
pdserve_router_phase_seconds_sum{phase="decode"} 4.0
pdserve_router_phase_seconds_count{phase="queue"} 4.0
pdserve_router_phase_seconds_sum{phase="queue"} 0.2
"""


def test_router_figures_are_deltas() -> None:
    f = router_figures(parse_prometheus(BEFORE), parse_prometheus(AFTER))
    assert f.prompt_tokens == {"computed": 40.0, "local": 7.0, "store": 300.0}
    assert f.phase_count == {"prefill": 4.0, "queue": 4.0}  # decode saw nothing new
    assert f.phase_mean_s == {"prefill": approx(0.5), "queue": approx(0.05)}


def test_router_figures_without_pdserve_metrics() -> None:
    f = router_figures(parse_prometheus(""), parse_prometheus("# TYPE x counter\nx_total 1\n"))
    assert (f.prompt_tokens, f.phase_count, f.phase_mean_s) == ({}, {}, {})


# --- the client against a fake OpenAI server ------------------------------------------------


async def _fake_server(bodies: list[dict]):
    """An aiohttp server streaming 3 chunks (one empty, one with 2 tokens) then usage."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if body["max_tokens"] == 99:
            return web.json_response({"error": {"message": "too long"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "", "bc"):
            await asyncio.sleep(0.02)
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 5, "completion_tokens": 3}
        usage["prompt_tokens_details"] = {"cached_tokens": 2}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return await serve_completions(completions)


def test_client_records_stream_and_errors() -> None:
    import aiohttp

    from pdserve.bench.serve.client import Client, run_requests
    from pdserve.bench.serve.workloads import Request

    bodies: list[dict] = []

    async def main() -> list[RequestRecord]:
        runner, base = await _fake_server(bodies)
        try:
            async with aiohttp.ClientSession() as session:
                import time

                client = Client(session, base, "m", time.perf_counter())
                reqs = [
                    Request(0.0, (101, 102), 3),
                    Request(0.0, (103,), 99),
                    Request(0.05, (104,), 3, after=0),
                ]
                return await run_requests(client, reqs, None, None)
        finally:
            await runner.cleanup()

    records = sorted(asyncio.run(main()), key=lambda r: r.index)
    ok, bad, child = records
    assert bodies[0] == {
        "model": "m",
        "prompt": [101, 102],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert ok.success and len(ok.chunk_s) == 2  # the empty-text chunk carries no token
    assert ok.text == "abc" and bad.text == ""
    assert (ok.output_tokens, ok.prompt_tokens, ok.cached_tokens) == (3, 5, 2)
    assert ok.last_chunk_s is not None and ok.last_chunk_s >= ok.chunk_s[-1]
    assert ok.tpot_s == pytest.approx((ok.e2el_s - ok.ttft_s) / 2)
    assert not bad.success and bad.error is not None and bad.error.startswith("HTTP 400")
    assert child.success and child.send_s >= ok.end_s + 0.05  # closed loop after its parent
