"""OpenAI/gRPC parameter parity on real processes (meta, store, one torch prefill and one torch
decode worker on the tiny model, the router): logprobs equal a plain Hugging Face forward,
and read, write and colocated plans give the same tokens and logprobs with penalties,
logit_bias and seeded sampling on; n > 1; the torch engine's refusal of response_format;
GetServerInfo; gRPC n > 1 token-exact."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import cluster_harness as tc
import pytest
import torch
from transformers import AutoTokenizer

from pdserve import grpcutil
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow

MODES = {
    "read": router_pb2.DISAGG_MODE_READ,
    "write": router_pb2.DISAGG_MODE_WRITE,
    "colocated": router_pb2.DISAGG_MODE_COLOCATED,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Iterator[tc.Cluster]:
    c = tc.Cluster(tmp_path_factory.mktemp("params"), tiny_model_dir, prefills=1)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def generate(cluster, **kw) -> router_pb2.GenerateResponse:
    with grpcutil.sync_channel(cluster.grpc) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        return stub.Generate(router_pb2.GenerateRequest(**kw), timeout=120)


def post(cluster, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        cluster.http + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([[*prompt, *out[:-1]]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), -1)


SAMPLINGS = {
    "greedy": dict(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
    "seeded-penalized": dict(
        max_tokens=12,
        temperature=0.9,
        seed=4242,
        logprobs=2,
        presence_penalty=0.6,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={17: 2.0, 40: -3.0},
        ignore_eos=True,
    ),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_match_hf_and_every_plan_agrees(cluster, tok, hf, name):
    salt = uuid.uuid4().hex[:8]
    text = f"{salt} a long prompt about rivers, mountains and the sea " * 3
    prompt = tok.encode(text)
    assert len(prompt) > 2 * tc.CS  # write mode has full chunks to publish
    results = {}
    for mode, value in MODES.items():
        results[mode] = generate(
            cluster,
            prompt=text,
            sampling=common_pb2.SamplingParams(**SAMPLINGS[name]),
            mode=value,
            request_id=f"{name}-{mode}-{salt}",
        )
    traces = cluster.traces(*(f"{name}-{mode}-{salt}" for mode in MODES))
    assert traces[f"{name}-read-{salt}"]["plan"] == "read"
    assert traces[f"{name}-write-{salt}"]["plan"] == "write"
    assert traces[f"{name}-colocated-{salt}"]["plan"] == "local"
    base = results["colocated"]
    ids = list(base.token_ids)
    assert len(ids) == 12
    ref = hf_logprobs(hf, prompt, ids)
    k = SAMPLINGS[name]["logprobs"]
    for mode, out in results.items():
        assert list(out.token_ids) == ids, mode
        lp = out.logprobs
        assert list(lp.token_ids) == ids, mode
        want = [float(ref[i, t]) for i, t in enumerate(ids)]
        assert list(lp.token_logprobs) == pytest.approx(want, abs=1e-4), mode
        for i, top in enumerate(lp.top_logprobs):
            best = torch.topk(ref[i], k)
            assert list(top.token_ids) == best.indices.tolist(), (mode, i)
            assert list(top.values) == pytest.approx(best.values.tolist(), abs=1e-4)


def test_openai_n_with_seed_equals_single_seeded_requests(cluster, tok):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "seed": 11}
    status, out = post(cluster, "/v1/completions", {**body, "n": 2, "temperature": 1.0})
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 16
    for i, choice in enumerate(out["choices"]):
        status, one = post(cluster, "/v1/completions", {**body, "seed": 11 + i, "temperature": 1.0})
        assert one["choices"][0]["text"] == choice["text"]
    assert out["choices"][0]["text"] != out["choices"][1]["text"]


def test_batched_prompts_equal_single_requests(cluster, tok):
    """A batch of prompts on the real workers: each choice is what the prompt alone gives."""
    prompts = ["Once upon a time", tok.encode("The lighthouse keeper")]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0.0}
    status, out = post(cluster, "/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        status, one = post(cluster, "/v1/completions", {**body, "prompt": prompt})
        assert status == 200 and one["choices"][0]["text"] == choice["text"]


def test_min_tokens_and_skip_special_tokens_reach_both_workers(cluster, tok):
    """vLLM's min_tokens and skip_special_tokens through the router to prefill and decode
    workers: EOS forced by logit_bias ends at once, with min_tokens 4 only as the fifth token
    (masked on prefill's first token and decode's next three); a forced special token adds no
    text unless skip_special_tokens is false."""
    eos, special = tok.eos_token_id, tok.bos_token_id
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}
    status, out = post(cluster, "/v1/completions", {**body, "logit_bias": {str(eos): 100}})
    assert status == 200 and out["usage"]["completion_tokens"] == 1, out
    forced = {**body, "logit_bias": {str(eos): 100}, "min_tokens": 4}
    status, out = post(cluster, "/v1/completions", forced)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "stop"
    status, out = post(cluster, "/v1/completions", {**forced, "min_tokens": 9})
    assert status == 400 and out["error"]["param"] == "min_tokens", out
    marks = {**body, "max_tokens": 3, "logit_bias": {str(special): 100}}
    status, out = post(cluster, "/v1/completions", marks)
    assert status == 200 and out["choices"][0]["text"] == "", out
    status, out = post(cluster, "/v1/completions", {**marks, "skip_special_tokens": False})
    assert status == 200 and out["choices"][0]["text"] == tok.bos_token * 3, out


def test_grpc_n_is_token_exact_with_single_requests(cluster, tok, hf_greedy):
    """GenerateStream with n = 2: greedy, both choices equal the Hugging Face greedy run;
    seeded sampling, choice i equals a single request with seed + i, token for token."""
    prompt = tok.encode("Once upon a time there was a lighthouse")
    want = hf_greedy(prompt, 8)
    with grpcutil.sync_channel(cluster.grpc) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)

        def stream(n: int, **sampling) -> dict[int, list[int]]:
            req = router_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                n=n,
                sampling=common_pb2.SamplingParams(max_tokens=8, **sampling),
            )
            out: dict[int, list[int]] = {}
            for m in stub.GenerateStream(req, timeout=120):
                out.setdefault(m.index, []).extend(m.token_ids)
            return out

        assert stream(2, temperature=0.0) == {0: want, 1: want}
        seeded = stream(2, temperature=1.0, seed=11)
        assert set(seeded) == {0, 1} and seeded[0] != seeded[1]
        for i in (0, 1):
            assert stream(1, temperature=1.0, seed=11 + i) == {0: seeded[i]}


def test_chat_logprobs_over_http(cluster):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    status, out = post(cluster, "/v1/chat/completions", body)
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 6
    for item in content:
        assert item["top_logprobs"][0]["token"] == item["token"]  # greedy: top-1 is the pick
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"])


def test_torch_engine_refuses_response_format_and_server_info(cluster):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
    }
    status, out = post(cluster, "/v1/chat/completions", body)
    assert status == 400, out
    # the worker's refusal, passed through (its message names the parameter)
    assert out["error"]["message"].startswith("response_format (json_object): the torch engine")
    with grpcutil.sync_channel(cluster.grpc) as ch:
        info = router_pb2_grpc.RouterServiceStub(ch).GetServerInfo(
            router_pb2.GetServerInfoRequest()
        )
    assert list(info.engines) == ["torch"]
    assert (info.chunk_size, info.prefill_workers, info.decode_workers) == (tc.CS, 1, 1)
