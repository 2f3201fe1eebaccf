"""``bench serve --history-rows``: the window's ideal prefix reuse given its history (exact, on
a hand-made trace), the history/window split and its prompts, the history replay's retries
and concurrency bound against an in-process fake server, and the reuse report."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from fake_completions import serve_completions

from pdserve.bench.serve import workloads as wl
from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.history import (
    HistoryOutcome,
    check_history_args,
    plan_history,
    replay,
    trace_rows,
)
from pdserve.bench.serve.status import BenchError
from pdserve.bench.serve.workloads import Request, TraceRow


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


# At 16 tokens per block: prompts of 32, 41 (16+16+9), 19 (16+3), 64 and 3 tokens.
ROWS = [
    TraceRow(0, 1024, 64, (0, 1)),
    TraceRow(1000, 1300, 64, (0, 1, 2)),
    TraceRow(2000, 600, 64, (0, 3)),
    TraceRow(3000, 2048, 64, (0, 1, 2, 4)),
    TraceRow(4000, 100, 64, (5,)),
]


def test_ideal_reuse_of_a_window_given_its_history() -> None:
    given = wl.ideal_prefix_reuse(ROWS, start=2, block=16)
    # row 2: block (0) from row 0 (16 tokens); row 3: (0), (0,1) whole and (0,1,2) as far as
    # row 1 held it (9 tokens); row 4: nothing
    assert (given.blocks, given.reused_blocks) == (7, 4)
    assert (given.tokens, given.reused_tokens) == (86, 16 + 16 + 16 + 9)
    assert given.fraction == pytest.approx(4 / 7)
    assert given.token_fraction == pytest.approx(57 / 86)
    alone = wl.ideal_prefix_reuse(ROWS[2:], block=16)
    # without history only row 3's block (0), from row 2
    assert (alone.blocks, alone.reused_blocks, alone.tokens, alone.reused_tokens) == (7, 1, 86, 16)
    assert alone.fraction == pytest.approx(1 / 7)
    # in whole 32-token cache blocks: row 3's 41 shared tokens are one block, row 2's 16 none
    assert (given.cache_block, given.cache_reused_tokens) == (32, 32)
    assert given.cache_fraction == pytest.approx(32 / 86)
    assert alone.cache_reused_tokens == 0
    assert wl.ideal_prefix_reuse(ROWS, start=2, block=16, cache_block=16).cache_reused_tokens == 48


def test_ideal_reuse_counts_chained_prefixes_and_computes_the_last_token() -> None:
    again = wl.ideal_prefix_reuse([ROWS[0], ROWS[0]], start=1, block=16)
    assert (again.reused_blocks, again.reused_tokens) == (2, 31)  # its last token is computed
    assert again.cache_reused_tokens == 0  # so its one 32-token block is not whole
    # id 1 behind another prefix is other content: not reused (reuse_fraction counts ids)
    other = [TraceRow(0, 1024, 1, (0, 1)), TraceRow(1, 1024, 1, (7, 1))]
    assert wl.ideal_prefix_reuse(other, start=1).reused_blocks == 0
    assert wl.reuse_fraction(other) == pytest.approx(1 / 4)
    empty = wl.ideal_prefix_reuse([], block=16)
    assert (empty.fraction, empty.token_fraction) == (0.0, 0.0)


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [*ROWS, *(TraceRow(5000 + 500 * i, 700, 64, (0, 1, 10 + i)) for i in range(5))]
    wl.write_trace(path, rows)
    return path


def test_history_and_window_split(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    argv = ["--workload", "trace", "--trace", str(path), "--vocab-size", "1000"]
    args = _parse([*argv, "--history-rows", "4", "--max-rows", "3"])
    history, window = trace_rows(args)
    rows = wl.read_trace(path)
    assert (history, window) == (rows[:4], rows[4:7])
    assert trace_rows(_parse([*argv, "--history-rows", "4"]))[1] == rows[4:]
    assert trace_rows(_parse(argv)) == ([], rows)

    from pdserve.bench.serve.run import build_workload

    measured = build_workload(args)
    assert len(measured) == 3 and measured[0].t_s == 0.0  # the window starts the clock
    plan = plan_history(args, 1000)
    assert plan is not None and (plan.rows, plan.window_rows) == (4, 3)
    assert plan.given == wl.ideal_prefix_reuse(rows[:7], 4, 16)
    assert plan.alone == wl.ideal_prefix_reuse(rows[4:7], 0, 16)
    # the same prompt construction: block ids 0 and 1 are the same tokens in both
    assert measured[1].prompt_token_ids[:32] == plan.requests[0].prompt_token_ids
    assert [r.t_s for r in plan.requests] == [0.0] * 4  # as fast as the bound allows
    paced = plan_history(_parse([*argv, "--history-rows", "4", "--history-rate", "2"]), 1000)
    assert paced is not None and [r.t_s for r in paced.requests] == [0.0, 0.5, 1.0, 1.5]
    fast = plan_history(_parse([*argv, "--history-rows", "4", "--history-rate", "4x"]), 1000)
    assert fast is not None and [r.t_s for r in fast.requests] == [0.0, 0.25, 0.5, 0.75]
    with pytest.raises(BenchError, match="only 10 rows"):
        trace_rows(_parse([*argv, "--history-rows", "10"]))


def test_history_flags_checked() -> None:
    check_history_args(_parse(["--workload", "trace", "--history-rows", "5"]))
    with pytest.raises(ValueError, match="needs --workload trace"):
        check_history_args(_parse(["--history-rows", "5"]))
    with pytest.raises(ValueError, match="find-capacity"):
        check_history_args(
            _parse(["--workload", "trace", "--history-rows", "5", "--find-capacity"])
        )
    with pytest.raises(SystemExit):
        _parse(["--history-rate", "0x"])


# --- the replay against a fake server -------------------------------------------------------


async def _fake_server(state: dict) -> tuple[object, str]:
    """Answers 429 to the first three requests, cuts the stream of prompt [200] the first
    time, 400 to prompt [400], else streams one token and usage (cached tokens 1)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        state["calls"] += 1
        state["inflight"] += 1
        state["peak"] = max(state["peak"], state["inflight"])
        try:
            await asyncio.sleep(0.02)
            if state["calls"] <= 3:
                return web.json_response(
                    {"error": "busy"}, status=429, headers={"Retry-After": "0"}
                )
            if prompt == [400]:
                return web.json_response({"error": {"message": "bad"}}, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if prompt == [200] and not state["cut"]:
                state["cut"] = True
                assert request.transport is not None
                request.transport.close()  # the connection dies mid-stream
                return resp
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 1},
            }
            event = {"choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            served = state["served"]
            served.append(tuple(prompt))
            return resp
        finally:
            state["inflight"] -= 1

    return await serve_completions(completions)


def test_replay_retries_overload_and_resets_within_its_concurrency_bound() -> None:
    import aiohttp

    state: dict = {"calls": 0, "inflight": 0, "peak": 0, "cut": False, "served": []}
    prompts = [(101, 102), (200,), (103,), (400,), (104, 105, 106), (107,), (108,), (109,)]
    requests = [Request(0.0, p, 1) for p in prompts]

    async def main() -> HistoryOutcome:
        runner, base = await _fake_server(state)
        try:
            async with aiohttp.ClientSession() as session:
                return await replay(
                    session, base, "m", requests, concurrency=3, attempts=5, backoff_s=0.01
                )
        finally:
            await runner.cleanup()  # type: ignore[attr-defined]

    out = asyncio.run(main())
    assert out.requests == 8 and out.served == 7 and out.failed == 1
    assert len(out.errors) == 1 and out.errors[0].startswith("HTTP 400")
    assert out.retried_for["HTTP 429"] == 3 and out.retries == 4  # 3 busy + 1 cut stream
    assert sum(out.retried_for.values()) == out.retries
    assert sorted(state["served"]) == sorted(p for p in prompts if p != (400,))
    assert state["peak"] <= 3  # never more in flight than the bound
    assert out.prompt_tokens == 10 and out.cached_tokens == 7
    assert "7 of 8 served, 1 failed, 4 retries" in out.summary()


def test_replay_gives_up_after_its_attempts_and_paces_its_rate() -> None:
    import time

    import aiohttp

    state: dict = {"calls": -1000, "inflight": 0, "peak": 0, "cut": False, "served": []}

    async def main() -> HistoryOutcome:
        runner, base = await _fake_server(state)  # busy for the first 1,003 calls
        try:
            async with aiohttp.ClientSession() as session:
                reqs = [Request(0.0, (101,), 1), Request(0.2, (102,), 1)]
                return await replay(
                    session, base, "m", reqs, concurrency=2, attempts=3, backoff_s=0.01
                )
        finally:
            await runner.cleanup()  # type: ignore[attr-defined]

    t0 = time.perf_counter()
    out = asyncio.run(main())
    assert (out.served, out.failed, out.retries) == (0, 2, 4)
    assert out.errors == ["HTTP 429 after 3 tries"] * 2
    assert time.perf_counter() - t0 >= 0.2  # the second waited for its time


def test_skip_history_measures_the_same_window_cold(tmp_path: Path) -> None:
    argv = ["--workload", "trace", "--trace", str(_trace(tmp_path)), "--history-rows", "4"]
    replayed = plan_history(_parse(argv), 1000)
    skipped = plan_history(_parse([*argv, "--skip-history"]), 1000)
    assert replayed is not None and skipped is not None
    assert skipped.requests == () and skipped.skipped and len(replayed.requests) == 4
    assert (skipped.given, skipped.alone) == (replayed.given, replayed.alone)
    assert (replayed.ideal, skipped.ideal) == (replayed.given, skipped.alone)
    with pytest.raises(ValueError, match="needs --history-rows"):
        check_history_args(_parse(["--workload", "trace", "--skip-history"]))
