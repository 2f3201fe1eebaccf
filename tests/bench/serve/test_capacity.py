"""``pdserve bench serve --find-capacity``: the rate search against fake systems, its flags,
the workload at a rate, the table, JSON and plot, and a whole search against a fake OpenAI
server in this process (a thread, no process)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.bench.serve.capacity import (
    Point,
    Search,
    SystemCapacity,
    capacity_doc,
    capacity_text,
    format_table,
    progress_line,
    rate_text,
    search_capacity,
)
from pdserve.bench.serve.capacity_run import rate_plan, releases, shift_tokens
from pdserve.bench.serve.cli import add_arguments, run_cli
from pdserve.bench.serve.workloads import TOKEN_LOW, Request


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Att:
    attainment: float


class FakeSystem:
    """Meets the SLOs for everyone up to ``capacity`` req/s, for half above."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.rates: list[float] = []

    def __call__(self, rate: float) -> Att:
        self.rates.append(rate)
        return Att(1.0 if rate <= self.capacity else 0.5)


def _check_bracketing(s: Search) -> None:
    passed = [r for r, p in s.tried if p.attainment >= 0.9]
    failed = [r for r, p in s.tried if p.attainment < 0.9]
    assert all(p < f for p in passed for f in failed)
    assert s.capacity == (max(passed) if passed else 0.0)
    assert s.hi == (min(failed) if failed else None)


def test_search_doubles_then_bisects() -> None:
    fake = FakeSystem(3.3)
    s = search_capacity(fake, 1.0, 0.9, max_steps=6, tolerance=0.1)
    assert fake.rates[:3] == [1.0, 2.0, 4.0]
    assert fake.rates[3] == pytest.approx(math.sqrt(8))
    assert len(fake.rates) == 6 and [r for r, _ in s.tried] == fake.rates
    _check_bracketing(s)
    assert s.capacity <= 3.3 < s.hi  # type: ignore[operator]
    assert s.hi / s.capacity <= 1.1  # type: ignore[operator]
    assert not s.at_least


def test_search_stops_at_tolerance() -> None:
    fake = FakeSystem(3.3)
    s = search_capacity(fake, 1.0, 0.9, max_steps=50, tolerance=0.01)
    _check_bracketing(s)
    assert s.hi / s.capacity <= 1.01  # type: ignore[operator]
    assert len(fake.rates) < 50
    # each bisection step is the geometric mean of the bracket it had
    assert s.capacity == pytest.approx(3.3, rel=0.01)


def test_search_halves_when_the_start_fails() -> None:
    fake = FakeSystem(3.3)
    s = search_capacity(fake, 20.0, 0.9, max_steps=6, tolerance=0.1)
    assert fake.rates[:3] == [20.0, 10.0, 5.0] and fake.rates[3] == 2.5
    assert fake.rates[4] == pytest.approx(math.sqrt(2.5 * 5))
    _check_bracketing(s)


def test_search_step_limits() -> None:
    one = search_capacity(FakeSystem(3.3), 1.0, 0.9, max_steps=1)
    assert [r for r, _ in one.tried] == [1.0] and one.capacity == 1.0 and one.at_least
    fast = search_capacity(FakeSystem(1e9), 1.0, 0.9, max_steps=6)
    assert [r for r, _ in fast.tried] == [1, 2, 4, 8, 16, 32] and fast.at_least
    assert fast.capacity == 32


def test_search_none_passed() -> None:
    fake = FakeSystem(0.0)
    s = search_capacity(fake, 1.0, 0.9, max_steps=4)
    assert fake.rates == [1.0, 0.5, 0.25, 0.125]
    assert s.capacity == 0.0 and s.lo is None and not s.at_least
    c = SystemCapacity("pdserve", s, 1000.0, "flag", None)
    assert capacity_text(c, "req/s").startswith("0 (below the lowest rate tried, 0.12")


def test_search_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        search_capacity(FakeSystem(1), 0.0, 0.9)
    with pytest.raises(ValueError):
        search_capacity(FakeSystem(1), 1.0, 0.9, max_steps=0)


# --- flags -----------------------------------------------------------------------------------


def test_defaults_keep_a_plain_run() -> None:
    args = _parse([])
    assert not args.find_capacity and args.attainment == 0.9 and args.rate_start is None
    assert (args.capacity_steps, args.rate_tolerance, args.calibrate_requests) == (6, 0.1, 16)
    assert args.prefill_tokens_per_s is None and args.bound_block == 16


@pytest.mark.parametrize(
    "argv",
    [["--find-capacity"], ["--find-capacity", "--goodput", "tpot:200", "e2el:3000"]],
)
def test_find_capacity_needs_a_ttft_slo(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert run_cli(_parse(argv)) == 1
    assert (
        "--find-capacity needs SLOs with a TTFT one: --goodput ttft:MS" in capsys.readouterr().err
    )


def test_find_capacity_checks_its_flags(capsys: pytest.CaptureFixture) -> None:
    argv = ["--find-capacity", "--goodput", "ttft:500", "--attainment", "1.5"]
    assert run_cli(_parse(argv)) == 1
    assert "--attainment must be in (0, 1]" in capsys.readouterr().err


# --- the workload at a rate ------------------------------------------------------------------


def test_trace_rate_is_a_time_scale() -> None:
    args = _parse(["--workload", "trace"])
    reqs = tuple(Request(t, (101,), 1) for t in (0.0, 1.0, 2.0, 4.0))
    plan = rate_plan(args, reqs, lambda a: ())
    assert plan.base_rate == 1.0 and plan.start == 1.0 and plan.unit == "req/s"
    assert [r.t_s for r in plan.at(2.0)] == [0.0, 0.5, 1.0, 2.0]
    assert plan.multiplier(2.0) == 2.0
    assert rate_plan(_parse(["--workload", "trace", "--rate-start", "3"]), reqs, len).start == 3


def test_poisson_rate_regenerates_with_the_same_seed() -> None:
    from pdserve.bench.serve.run import build_workload

    args = _parse(["--num-prompts", "20", "--vocab-size", "1000", "--seed", "3"])
    reqs = build_workload(args)
    plan = rate_plan(args, reqs, build_workload)
    assert plan.start == 1.0 and plan.base_rate is None and plan.multiplier(1.0) is None
    slow, fast = plan.at(1.0), plan.at(4.0)
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in slow]
    assert [len(r.prompt_token_ids) for r in slow] == [len(r.prompt_token_ids) for r in reqs]
    assert fast[-1].t_s == pytest.approx(slow[-1].t_s / 4)
    multi = _parse(["--workload", "multi-round", "--request-rate", "0.5"])
    assert rate_plan(multi, (), build_workload).unit == "conv/s"
    assert rate_plan(multi, (), build_workload).start == 0.5


def test_shift_tokens_keeps_sharing_and_changes_every_id() -> None:
    vocab = 200
    reqs = [Request(0.0, (101, 150, 199, 5), 1), Request(1.0, (101, 150, 7), 2, after=0)]
    assert shift_tokens(reqs, 0, vocab) == tuple(reqs)
    a, b = shift_tokens(reqs, 1, vocab)
    assert a.prompt_token_ids == (102, 151, TOKEN_LOW, 5)  # wraps; special ids stay
    assert b.prompt_token_ids[:2] == a.prompt_token_ids[:2] and b.after == 0
    assert all(TOKEN_LOW <= t < vocab for t in a.prompt_token_ids[:3])


def test_releases_of_dependent_requests_are_measured() -> None:
    reqs = [Request(0.5, (1,), 1), Request(0.2, (1,), 1, after=0), Request(0.1, (1,), 1, after=1)]
    assert releases(reqs, {1: 3.0}) == [0.5, 3.0, 3.1]


# --- output ----------------------------------------------------------------------------------


def _point(system: str, rate: float, att: float, mult: float | None = None) -> Point:
    return Point(system, rate, mult, att, int(att * 10), 10, 10, 500.0, 900.0, 50.0, 90.0, 2.0,
                 min(1.0, att + 0.05), 10, 1234, 5.0, att >= 0.9)  # fmt: skip


def _systems() -> list[SystemCapacity]:
    a = Search(lo=2.0, hi=4.0, tried=[(r, _point("pdserve", r, x, r / 2)) for r, x in ((2.0, 0.95), (4.0, 0.5))])  # fmt: skip
    b = Search(lo=1.0, hi=2.0, tried=[(r, _point("colocated", r, x, r / 2)) for r, x in ((2.0, 0.6), (1.0, 0.92))])  # fmt: skip
    return [
        SystemCapacity("pdserve", a, 900.0, "calibrated", 2.0),
        SystemCapacity("colocated", b, 800.0, "calibrated", 2.0),
    ]


def test_table_json_and_progress(tmp_path: Path) -> None:
    systems = _systems()
    p = systems[0].points[0]
    assert progress_line(p, "req/s") == "pdserve: rate 2.00 req/s (x1.00) -> 95.0% on time (bound 100.0%); TTFT p99 0.90 s, TPOT p99 90 ms"  # fmt: skip
    table = format_table(systems, "req/s", 0.9, {"ttft": 2000.0, "tpot": 200.0})
    assert "Capacity at 90% attainment (ttft<=2000ms tpot<=200ms)" in table
    assert "pdserve capacity: 2.00 req/s (x1.00), below 4.00" in table
    assert "bound at 800 prompt tok/s (calibrated)" in table
    assert "ratio pdserve / colocated: 2.00x" in table
    args = _parse(["--find-capacity", "--goodput", "ttft:2000"])
    doc = json.loads(json.dumps(capacity_doc(systems, args, "req/s")))
    assert doc["ratio"] == 2.0 and doc["capacity"]["pdserve"]["rate"] == 2.0
    assert doc["capacity"]["colocated"]["bracket"] == [1.0, 2.0]
    assert doc["capacity"]["pdserve"]["multiplier"] == 1.0
    assert len(doc["points"]) == 4 and doc["points"][0]["bound"] == 1.0
    assert doc["prefill_tokens_per_s"]["pdserve"] == {"value": 900.0, "source": "calibrated"}
    assert doc["args"]["find_capacity"] is True


def test_the_run_at_the_baselines_capacity_is_reported() -> None:
    """The system under test at the baseline's capacity: in the table, the JSON and the
    points (once, also when its search ran at that rate itself)."""
    pdserve, colocated = _systems()
    extra = _point("pdserve", 1.0, 1.0, 0.5)
    systems = [dataclasses.replace(pdserve, at_baseline=extra), colocated]
    table = format_table(systems, "req/s", 0.9, {"ttft": 2000.0})
    assert "pdserve at colocated's capacity (1.00 req/s): 100.0% on time (10 of 10)" in table
    assert "pdserve               1.00   0.50   100.0%" in table  # its row, with the search's
    doc = capacity_doc(systems, _parse(["--find-capacity", "--goodput", "ttft:2000"]), "req/s")
    assert doc["capacity"]["pdserve"]["at_baseline_capacity"] == {
        "rate": 1.0, "attainment": 1.0, "good": 10, "total": 10
    }  # fmt: skip
    assert "at_baseline_capacity" not in doc["capacity"]["colocated"]
    assert [p["rate"] for p in doc["points"]] == [2.0, 4.0, 1.0, 2.0, 1.0]
    tried = pdserve.search.tried[0][1]  # a rate the search ran: the same point, listed once
    assert len(dataclasses.replace(pdserve, at_baseline=tried).points) == 2


def test_halved_rates_are_not_rounded_away() -> None:
    assert [rate_text(r) for r in (2.0, 1.5, 0.5, 0.25, 0.125, 0.0625)] == [
        "2.00", "1.50", "0.50", "0.25", "0.125", "0.0625"
    ]  # fmt: skip
    assert rate_text(math.sqrt(0.125 * 0.25)) == "0.177"
    points = [(r, _point("pdserve", r, 0.5)) for r in (0.25, 0.125)]
    c = SystemCapacity("pdserve", Search(None, 0.125, points), 62.0, "calibrated", None)
    assert progress_line(points[1][1], "req/s").startswith("pdserve: rate 0.125 req/s ->")
    assert capacity_text(c, "req/s") == "0 (below the lowest rate tried, 0.125 req/s)"
    assert "         0.125" in format_table([c], "req/s", 0.9, {"ttft": 2000.0})


@pytest.mark.slow  # matplotlib may run fc-list to build its font cache
def test_capacity_plot(tmp_path: Path) -> None:
    from pdserve.bench.serve.plots import write_capacity_plot

    systems = _systems()
    series = {c.name: [(q.rate, q.attainment, q.bound) for q in c.points] for c in systems}
    out = write_capacity_plot(tmp_path / "cap", series, 0.9)
    assert out.name == "capacity.png" and out.stat().st_size > 1000


# --- a whole search against a fake server ----------------------------------------------------


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list[dict]]]:
    """An OpenAI-like server in a thread: one token chunk per request, then usage."""
    from aiohttp import web

    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def start() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{holder['port']}", bodies
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_whole_search_against_a_fake_server(
    fake_server: tuple[str, list[dict]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base, bodies = fake_server
    argv = f"--target {base} --model m --vocab-size 1000 --num-prompts 5 --input-len 20 "
    argv += "--output-len 2 --goodput ttft:10000 --find-capacity --rate-start 100 "
    argv += f"--capacity-steps 2 --calibrate-requests 3 --disable-tqdm --json {tmp_path}/c.json"
    assert run_cli(_parse(argv.split())) == 0
    # warm-up once (2), calibration (3 prompts, max_tokens 1), then 2 runs of 5
    assert len(bodies) == 2 + 3 + 10
    assert [b["max_tokens"] for b in bodies[2:5]] == [1, 1, 1]
    run1, run2 = bodies[5:10], bodies[10:15]
    first = {tuple(b["prompt"]) for b in run1}
    shifted = {
        tuple(TOKEN_LOW + (t - TOKEN_LOW + 1) % (1000 - TOKEN_LOW) for t in p) for p in first
    }
    assert {tuple(b["prompt"]) for b in run2} == shifted  # fresh ids, same prompts otherwise
    doc = json.loads((tmp_path / "c.json").read_text())
    cap = doc["capacity"]["pdserve"]
    assert cap["rate"] == 200.0 and cap["at_least"] and cap["runs"] == 2
    assert [p["rate"] for p in doc["points"]] == [100.0, 200.0]
    assert all(p["attainment"] == 1.0 and p["bound"] == 1.0 for p in doc["points"])
    assert doc["prefill_tokens_per_s"]["pdserve"]["source"] == "calibrated"
    assert doc["prefill_tokens_per_s"]["pdserve"]["value"] > 0
    out = capsys.readouterr()
    assert "pdserve capacity: >= 200.00 req/s, no rate tried failed" in out.out
    assert "pdserve: rate 100.00 req/s -> 100.0% on time (bound 100.0%)" in out.err


def test_the_baseline_is_searched_first_and_sets_a_run_of_the_target(
    fake_server: tuple[str, list[dict]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """With a baseline, its search comes first; the system under test then runs once more at
    the baseline's capacity (150 req/s here: a rate its own search, 100 then 200, skipped)."""
    from pdserve.bench.serve import capacity_run, run
    from pdserve.bench.serve.run import System

    base, bodies = fake_server
    order: list[str] = []

    @contextlib.contextmanager
    def two_systems(args: argparse.Namespace, baseline_first: bool = False):
        assert baseline_first
        yield iter([System("colocated", base, "", False), System("pdserve", base, "", True)])

    real_search = capacity_run.search_system

    def search(sut, plan, slos, mean_input):
        order.append(sut.name)
        cap = real_search(sut, plan, slos, mean_input)
        if sut.name == "colocated":  # as if 150 had been its highest passing rate
            cap = dataclasses.replace(cap, search=Search(150.0, 200.0, cap.search.tried))
        return cap

    monkeypatch.setattr(run, "each_system", two_systems)
    monkeypatch.setattr(capacity_run, "search_system", search)
    argv = f"--target {base} --model m --vocab-size 1000 --num-prompts 5 --input-len 20 "
    argv += "--output-len 2 --goodput ttft:10000 --find-capacity --rate-start 100 "
    argv += f"--capacity-steps 2 --calibrate-requests 3 --disable-tqdm --json {tmp_path}/c.json"
    assert run_cli(_parse(argv.split())) == 0
    assert order == ["colocated", "pdserve"]
    # each: warm-up (2), calibration (3), 2 runs of 5; then pdserve's run at 150
    assert len(bodies) == 2 * (2 + 3 + 10) + 5
    doc = json.loads((tmp_path / "c.json").read_text())
    assert list(doc["capacity"]) == ["pdserve", "colocated"]  # the system under test first
    assert doc["capacity"]["pdserve"]["at_baseline_capacity"]["rate"] == 150.0
    assert doc["capacity"]["pdserve"]["runs"] == 2  # the extra run is not the search's
    out = capsys.readouterr()
    assert "pdserve: rate 150.00 req/s -> 100.0% on time (bound 100.0%); TTFT p99" in out.err
    assert "ms (the baseline's capacity)" in out.err
    assert "pdserve at colocated's capacity (150.00 req/s): 100.0% on time (5 of 5)" in out.out


def test_a_target_no_rate_can_reach_is_not_searched(
    fake_server: tuple[str, list[dict]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A trace whose requests arrive in bursts too big for one TTFT window: at 100 prompt
    tokens/s and a 1 s TTFT, 2 of each burst of 5 can be on time at any rate (40%), so a 90%
    target is refused before any run; a 30% target is searched."""
    base, bodies = fake_server
    trace = tmp_path / "bursts.jsonl"
    rows = [
        {"timestamp": t, "input_length": 1536, "output_length": 64, "hash_ids": [3 * i + k + 10 * t for k in range(3)]}
        for t in (0, 3000) for i in range(5)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = f"--target {base} --model m --vocab-size 1000 --workload trace --trace {trace} "
    argv += "--block-tokens 16 --goodput ttft:1000 --find-capacity --prefill-tokens-per-s 100 "
    argv += f"--capacity-steps 2 --disable-tqdm --json {tmp_path}/c.json"
    assert run_cli(_parse(argv.split())) == 0
    assert bodies == []  # not even a warm-up: the bound alone decided
    out = capsys.readouterr()
    assert "pdserve: no rate can reach 90% on time: at 100 prompt tokens/s at most 4 of 10 (40.0%)" in out.err  # fmt: skip
    assert (
        "pdserve capacity: none at any rate (the bound at any rate is under the target" in out.out
    )
    assert "at any rate at most 40.0% on time" in out.out
    cap = json.loads((tmp_path / "c.json").read_text())["capacity"]["pdserve"]
    assert cap["skipped_unreachable"] and cap["runs"] == 0 and cap["none_passed"]
    assert cap["any_rate_bound"] == {"on_time": 4, "total": 10, "fraction": 0.4}
    assert run_cli(_parse([*argv.split(), "--attainment", "0.3"])) == 0
    assert len(bodies) == 2 + 2 * 10  # searched: warm-up, then two runs of the trace
    cap = json.loads((tmp_path / "c.json").read_text())["capacity"]["pdserve"]
    assert not cap["skipped_unreachable"] and cap["runs"] == 2


def test_a_plain_run_measures_the_target_once(
    fake_server: tuple[str, list[dict]], tmp_path: Path
) -> None:
    """Without --find-capacity the same system iteration (``run.each_system``) measures the
    target once: warm-up, the workload, its JSON."""
    base, bodies = fake_server
    argv = f"--target {base} --model m --vocab-size 1000 --num-prompts 4 --input-len 20 "
    argv += f"--output-len 2 --disable-tqdm --json {tmp_path}/r.json"
    assert run_cli(_parse(argv.split())) == 0
    assert len(bodies) == 2 + 4  # warm-up, then the workload
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [s["name"] for s in doc["systems"]] == ["pdserve"] and "comparison" not in doc


def test_the_long_prefill_workload_is_built_from_its_flags() -> None:
    from pdserve.bench.serve.run import build_workload

    args = _parse(
        ["--workload", "long-prefill", "--num-prompts", "8", "--long-fraction", "0.5",
         "--long-len-min", "40", "--long-len-max", "60", "--input-len", "12",
         "--stream-output-len", "30", "--output-len", "3", "--vocab-size", "1000",
         "--request-rate", "2"]
    )  # fmt: skip
    reqs = build_workload(args)
    assert sorted(r.max_tokens for r in reqs) == [3] * 4 + [30] * 4
    assert all(40 <= len(r.prompt_token_ids) <= 60 for r in reqs if r.max_tokens == 3)
    assert all(len(r.prompt_token_ids) == 12 for r in reqs if r.max_tokens == 30)
    assert rate_plan(args, reqs, build_workload).start == 2.0
