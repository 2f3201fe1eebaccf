from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve import kvformat
from pdserve.kvformat import HEADER_SIZE, ChunkFormatError

FP = bytes(range(32))
KEY = "a" * 64


def _kv(dtype=torch.float32, shape=(2, 2, 3, 5, 8)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(dtype):
    kv = _kv(dtype)
    buf = kvformat.encode(kv, FP, KEY)
    assert len(buf) == kvformat.encoded_size(tuple(kv.shape), dtype)
    header, out = kvformat.decode(buf, FP)
    assert header.dtype == dtype and header.shape == tuple(kv.shape) and header.num_tokens == 5
    assert torch.equal(out, kv)


@settings(max_examples=25, deadline=None)
@given(st.tuples(*[st.integers(1, 4)] * 2, st.integers(0, 9), st.integers(1, 8)))
def test_round_trip_any_shape(dims):
    layers, heads, tokens, head_dim = dims
    kv = torch.arange(layers * 2 * heads * tokens * head_dim, dtype=torch.float32).reshape(
        layers, 2, heads, tokens, head_dim
    )
    assert torch.equal(kvformat.decode(kvformat.encode(kv, FP, KEY))[1], kv)


def test_decode_aliases_a_writable_buffer():
    buf = bytearray(kvformat.encode(_kv(), FP, KEY))
    _, out = kvformat.decode(buf)
    out.zero_()
    assert bytes(buf[HEADER_SIZE:]) == bytes(len(buf) - HEADER_SIZE)


@pytest.mark.parametrize(
    "offset", [0, 5, 10, 40, 70, 90, 100, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 77, -1]
)
def test_any_flipped_byte_is_detected(offset):
    buf = bytearray(kvformat.encode(_kv(), FP, KEY))
    buf[offset] ^= 0x01
    with pytest.raises(ChunkFormatError):
        kvformat.decode(buf, FP)


def test_truncated_wrong_fingerprint_and_garbage():
    buf = kvformat.encode(_kv(), FP, KEY)
    with pytest.raises(ChunkFormatError, match="truncated"):
        kvformat.decode(buf[:-1])
    with pytest.raises(ChunkFormatError, match="truncated"):
        kvformat.decode(buf[:10])
    with pytest.raises(ChunkFormatError, match="fingerprint"):
        kvformat.decode(buf, bytes(32))
    with pytest.raises(ChunkFormatError, match="magic"):
        kvformat.decode(b"x" * 200)


def test_a_chunk_is_bound_to_its_key():
    """A whole, valid chunk read from another key (a copy, a late writer's bytes in a reused
    region) is refused; the key it was written for reads it."""
    buf = kvformat.encode(_kv(), FP, KEY)
    assert torch.equal(kvformat.decode(buf, FP, key=KEY)[1], _kv())
    with pytest.raises(ChunkFormatError, match="another key"):
        kvformat.decode(buf, FP, key="b" * 64)


def test_encode_rejects_bad_input():
    with pytest.raises(ChunkFormatError, match="layers, 2"):
        kvformat.encode(torch.zeros(2, 3, 4), FP, KEY)
    with pytest.raises(ChunkFormatError, match="dtype"):
        kvformat.encode(torch.zeros(1, 2, 1, 1, 1, dtype=torch.int32), FP, KEY)
    with pytest.raises(ChunkFormatError, match="32 bytes"):
        kvformat.encode(_kv(), b"short", KEY)
    with pytest.raises(ChunkFormatError, match="cannot hold"):
        kvformat.encode_into(bytearray(10), _kv(), FP, KEY)
