"""The torch engine's sampler beyond temperature/top-k/top-p: logit_bias, the penalties
(vLLM's order and semantics, against hand-computed logits), logprobs (the raw model
distribution, against a plain Hugging Face forward), stop token ids, and that a disaggregated
generation (prefill -> store -> decode) equals a local one token for token and logprob for
logprob with all of them on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engines.torch_engine.sampler import (
    process_logits,
    sample_token,
    token_logprob,
)
from pdserve.errors import InvalidArgument
from pdserve.requests import Finish, Sampling


def test_process_logits_matches_hand_computed_values():
    logits = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    s = Sampling(
        logit_bias=((1, 2.0),),
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    out = process_logits(logits, s, prompt=[0, 4], output=[3, 3, 2])
    # bias: [1, 0, .5, 3, -1]; repetition over {0, 2, 3, 4}: positives / 2, negatives * 2
    # -> [.5, 0, .25, 1.5, -2]; frequency (counts 3: 2, 2: 1) and presence (3, 2)
    # -> [.5, 0, .25 - .5 - .25, 1.5 - 1 - .25, -2]
    assert out.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.25, -2.0])
    assert logits.tolist() == [1.0, -2.0, 0.5, 3.0, -1.0]  # the input is left alone
    # nothing asked: the same tensor back
    assert process_logits(logits, Sampling()) is logits
    # penalties of generated tokens only: the prompt alone changes nothing but repetition
    only = Sampling(frequency_penalty=1.0, presence_penalty=1.0)
    assert process_logits(logits, only, prompt=[3]).tolist() == logits.tolist()


def test_greedy_follows_the_processed_logits_and_bias_can_force_a_token():
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    greedy = Sampling(temperature=0.0)
    assert sample_token(logits, greedy, 0, 0) == 1
    # token 1 already generated twice: frequency 1.0 takes it below token 2
    pen = Sampling(temperature=0.0, frequency_penalty=1.0)
    assert sample_token(logits, pen, 0, 0, output=[1, 1]) == 2
    forced = Sampling(temperature=1.0, logit_bias=((3, 100.0),), seed=1)
    assert all(sample_token(logits, forced, 1, step) == 3 for step in range(20))
    banned = Sampling(temperature=1.0, logit_bias=((1, -100.0), (2, -100.0)))
    assert all(sample_token(logits, banned, 5, step) in (0, 3) for step in range(50))


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    """vLLM's min_tokens: while fewer tokens are out, EOS and the stop token ids cannot be
    picked (the next best is); from then on they can. The raw logits are left alone."""
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0])  # 1 is the best, then 2
    s = Sampling(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    assert sample_token(logits, s, 0, 0, eos_token_id=1) == 3  # 1 (EOS) and 2 held
    assert sample_token(logits, s, 0, 1, output=[3], eos_token_id=1) == 3
    assert sample_token(logits, s, 0, 2, output=[3, 3], eos_token_id=1) == 1  # reached
    assert logits.tolist() == [0.0, 5.0, 4.0, 3.0]
    assert sample_token(logits, Sampling(temperature=0.0), 0, 0, eos_token_id=1) == 1
    sampled = Sampling(temperature=1.0, min_tokens=1)
    assert all(sample_token(logits, sampled, 3, k, eos_token_id=1) != 1 for k in range(30))
    with pytest.raises(InvalidArgument, match=r"min_tokens must be in \[0, max_tokens \(4\)\]"):
        Sampling(max_tokens=4, min_tokens=5).validate(100)


def test_token_logprob_is_the_raw_distribution():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    lp = token_logprob(logits, 2, 2)
    ref = torch.log_softmax(logits, -1)
    assert lp.token_id == 2 and lp.logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([float(ref[1]), float(ref[2])])
    assert token_logprob(logits, 0, 0).top == ()


def test_validation_names_the_field():
    for kwargs, param in (
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias=((3, 150.0),)), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
    ):
        with pytest.raises(InvalidArgument) as err:
            Sampling(**kwargs).validate(100)
        assert err.value.param == param
    with pytest.raises(InvalidArgument) as err:
        Sampling(stop_token_ids=(10_000,)).check_vocab(512)
    assert err.value.param == "stop_token_ids"


# ------------------------------------------------------------------ the engine, tiny model

CS = 16


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 500 + 5 for i in range(n)]


async def _events(agen) -> list:
    return [ev async for ev in agen]


def _local(eng, toks, sampling):
    events = asyncio.run(_events(eng.generate("local", toks, sampling)))
    ids = [t for ev in events for t in ev.token_ids]
    lps = [lp for ev in events for lp in ev.logprobs]
    return ids, lps, events


def _split(eng, toks, sampling):
    async def go():
        out = await eng.prefill("split", toks, sampling)
        events = await _events(
            eng.generate("split", toks, sampling, kv=out.kv, first_token_id=out.first_token_id)
        )
        return out, events

    out, events = asyncio.run(go())
    ids = [t for ev in events for t in ev.token_ids]
    # the echoed first token has no logprobs from decode: prefill's are its
    lps = ([out.first_logprob] if out.first_logprob else []) + [
        lp for ev in events for lp in ev.logprobs
    ]
    return ids, lps, events


@torch.inference_mode()
def _hf_logprobs(model, toks: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward over prompt + output: row i is the distribution of
    output token i."""
    ids = torch.tensor([[*toks, *out[:-1]]])
    logits = model(input_ids=ids).logits[0, len(toks) - 1 :]
    return torch.log_softmax(logits.float(), -1)


SAMPLINGS = [
    Sampling(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True),
    Sampling(
        max_tokens=10,
        temperature=0.8,
        seed=123,
        logprobs=2,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((17, 3.0), (40, -5.0)),
        ignore_eos=True,
    ),
    Sampling(
        max_tokens=10,
        temperature=0.0,
        logprobs=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        ignore_eos=True,
    ),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded-penalized", "greedy-pen"])
@pytest.mark.parametrize("n", [5, 33])
def test_logprobs_match_hf_and_split_equals_local(eng, hf_model, sampling: Sampling, n: int):
    toks = prompt(n)
    ids, lps, _ = _local(eng, toks, sampling)
    sids, slps, _ = _split(eng, toks, sampling)
    assert sids == ids
    assert len(ids) == sampling.max_tokens == len(lps) == len(slps)
    assert [x.token_id for x in lps] == ids
    ref = _hf_logprobs(hf_model, toks, ids)
    for i, (x, y) in enumerate(zip(lps, slps, strict=True)):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert x.logprob == pytest.approx(float(ref[i, ids[i]]), abs=1e-4)
        assert len(x.top) == sampling.logprobs
        if x.top:
            want = torch.topk(ref[i], sampling.logprobs)
            assert [t for t, _ in x.top] == want.indices.tolist()
            assert [v for _, v in x.top] == pytest.approx(want.values.tolist(), abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    if sampling.greedy and not sampling.penalized:
        assert [x.top[0][0] for x in lps] == ids  # greedy: the top-1 token is the sampled one


def test_penalties_change_greedy_output_like_a_reference_loop(eng, hf_model):
    """A greedy loop over plain HF logits with the penalties applied by hand gives the
    engine's tokens."""
    toks = prompt(9)
    s = Sampling(
        max_tokens=12,
        temperature=0.0,
        frequency_penalty=2.0,
        presence_penalty=1.0,
        repetition_penalty=1.5,
        logit_bias=((7, 1.0),),
        ignore_eos=True,
    )
    ids, _, _ = _local(eng, toks, s)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            logits = hf_model(input_ids=torch.tensor([[*toks, *out]])).logits[0, -1].float()
            logits = logits.clone()
            logits[7] += 1.0
            seen = set(toks) | set(out)
            for t in seen:
                logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
            for t in set(out):
                logits[t] -= 2.0 * out.count(t) + 1.0
            out.append(int(torch.argmax(logits)))
    assert ids == out
    plain, _, _ = _local(eng, toks, Sampling(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert plain != ids  # the penalties did something


def test_stop_token_ids_end_with_stop_and_no_text(eng):
    toks = prompt(7)
    greedy = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids, _, _ = _local(eng, toks, greedy)
    stop = ids[3]
    first = ids.index(stop)
    s = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    for run in (_local, _split):
        sids, _, sevents = run(eng, toks, s)
        assert sids == ids[: first + 1]
        assert sevents[-1].finish == Finish.STOP
        text = "".join(ev.text for ev in sevents)
        assert text == eng.decode_text(ids[:first])


def test_response_format_is_refused_by_the_torch_engine(eng):
    for s in (Sampling(json_object=True), Sampling(json_schema='{"type": "object"}')):
        with pytest.raises(InvalidArgument) as err:
            asyncio.run(eng.prefill("j", prompt(4), s))
        assert err.value.param == "response_format" and "guided decoding" in str(err.value)
        with pytest.raises(InvalidArgument):
            _local(eng, prompt(4), s)
