"""pdserve/requests_codec.py: every shared request type survives its proto and back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.requests import KVRef, Sampling, TokenLogprob
from pdserve.requests_codec import (
    kvref_from_proto,
    kvref_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from pdserve.v1 import common_pb2

U32 = 2**32 - 1
# Proto floats are 32-bit: values that are exact in float32 survive the wire unchanged.
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
token = st.integers(0, U32)

samplings = st.builds(
    Sampling,
    max_tokens=st.integers(1, U32),
    temperature=f32,
    top_p=f32,
    top_k=st.integers(0, U32),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(min_size=1), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    presence_penalty=f32,
    frequency_penalty=f32,
    repetition_penalty=f32,
    logit_bias=st.dictionaries(token, f32, max_size=4).map(lambda d: tuple(sorted(d.items()))),
    stop_token_ids=st.lists(token, max_size=4).map(tuple),
    logprobs=st.none() | st.integers(0, 20),
    json_object=st.booleans(),
    json_schema=st.text(max_size=20),
    min_tokens=st.integers(0, U32),
    skip_special_tokens=st.booleans(),
)


@given(samplings)
def test_sampling_round_trips(s: Sampling) -> None:
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(s).SerializeToString())
    assert sampling_from_proto(wire, default_max_tokens=7) == s


def test_unset_sampling_fields_decode_to_the_documented_defaults() -> None:
    s = sampling_from_proto(common_pb2.SamplingParams(), default_max_tokens=9)
    assert s == Sampling(max_tokens=9)
    # and the defaults stay off the wire (but temperature and top_p, always sent)
    p = sampling_to_proto(Sampling())
    assert not p.HasField("seed") and not p.HasField("repetition_penalty")
    assert not p.HasField("logprobs") and p.HasField("temperature")
    assert not p.HasField("skip_special_tokens") and p.min_tokens == 0


logprob_lists = st.lists(
    st.builds(
        TokenLogprob,
        token_id=token,
        logprob=f32,
        top=st.lists(st.tuples(token, f32), max_size=3).map(tuple),
    ),
    max_size=4,
)


@given(logprob_lists)
def test_logprobs_round_trip(items: list[TokenLogprob]) -> None:
    assert logprobs_from_proto(logprobs_to_proto(items)) == items


@given(
    st.builds(
        KVRef,
        chunk_keys=st.lists(st.text(max_size=8), max_size=3).map(tuple),
        tail_key=st.text(max_size=8),
        num_tokens=st.integers(0, U32),
        chunk_size=st.integers(0, U32),
        fingerprint=st.binary(max_size=32),
    )
)
def test_kvref_round_trips(kv: KVRef) -> None:
    assert kvref_from_proto(kvref_to_proto(kv)) == kv
