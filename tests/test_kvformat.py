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


# --------------------------------------------------------------------------- encodings


def _reseal(buf: bytearray) -> bytearray:
    """Recomputes the header checksum after a test edits the header on purpose (a well-formed
    chunk of another version or encoding, not a corrupt one)."""
    import blake3

    buf[100:108] = blake3.blake3(bytes(buf[:100])).digest(length=16)[:8]
    return buf


def _v2_chunk(kv: torch.Tensor, fp: bytes, key: str) -> bytes:
    """A version-2 chunk, packed by hand from the documented layout (independent of
    ``encode``): what every chunk stored before encodings existed looks like."""
    import struct

    import blake3

    payload = kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    head = struct.pack(
        "<4sHBB5IQ32s16s16s",
        b"PDKV",
        2,
        kvformat.DTYPE_CODES[kv.dtype],
        0,
        *kv.shape,
        len(payload),
        fp,
        blake3.blake3(payload).digest(length=16),
        blake3.blake3(key.encode()).digest(length=16),
    )
    return head + blake3.blake3(head).digest(length=16)[:8] + bytes(20) + payload


def _fp8_error_bound(kv: torch.Tensor) -> torch.Tensor:
    """Per element: what e4m3 with a per-channel scale (amax / 448) may lose. A scaled value
    in e4m3's normal range (>= 2**-6) keeps 3 mantissa bits (error <= 1/16 of itself); below,
    subnormal steps of 2**-9 (error <= 2**-10 in scaled units)."""
    scale = kv.float().abs().amax(dim=3, keepdim=True) / kvformat.FP8_MAX
    return torch.maximum(kv.float().abs() / 16, scale * 2**-10) * (1 + 1e-6)


def test_encoding_codes_cover_the_fingerprint_names():
    from pdserve.hashing import KV_COMPRESSIONS

    assert tuple(kvformat.ENCODING_CODES) == KV_COMPRESSIONS
    assert kvformat.ENCODING_CODES == {"none": 0, "bf16": 1, "fp8": 2}  # a wire format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("encoding", ["none", "bf16", "fp8"])
def test_every_encoding_round_trips_to_the_kv_dtype(dtype, encoding):
    kv = _kv(dtype, shape=(3, 2, 2, 32, 16)) * 3
    buf = kvformat.encode(kv, FP, KEY, encoding)
    assert len(buf) == kvformat.encoded_size(tuple(kv.shape), dtype, encoding)
    header, out = kvformat.decode(buf, FP, key=KEY)
    assert out.dtype == dtype and header.dtype == dtype and header.shape == tuple(kv.shape)
    stored = kvformat.stored_encoding(dtype, encoding)
    assert header.encoding == stored and header.version == (2 if stored == "none" else 3)
    if stored == "none":
        assert torch.equal(out, kv)
    elif stored == "bf16":  # exactly bfloat16's rounding of each value
        assert torch.equal(out, kv.to(torch.bfloat16).to(dtype))
    else:
        # fp8 error bound, plus the rounding of the result back to a 16-bit dtype
        slack = 0 if dtype == torch.float32 else 2**-7
        bound = _fp8_error_bound(kv) + out.float().abs() * slack
        assert bool(((out.float() - kv.float()).abs() <= bound).all())


def test_sizes_halve_and_quarter():
    shape = (30, 2, 3, 256, 64)  # SmolLM2, one 256-token chunk
    raw = kvformat.encoded_size(shape, torch.float32)
    assert raw == 128 + 11_796_480
    assert kvformat.encoded_size(shape, torch.float32, "bf16") == 128 + 11_796_480 // 2
    scales = 30 * 2 * 3 * 64 * 4
    assert kvformat.encoded_size(shape, torch.float32, "fp8") == 128 + 11_796_480 // 4 + scales
    assert kvformat.encoded_size(shape, torch.bfloat16, "fp8") == 128 + 11_796_480 // 4 + scales
    # bf16 of bfloat16 KV is the same bytes: written as none
    assert kvformat.encoded_size(shape, torch.bfloat16, "bf16") == kvformat.encoded_size(
        shape, torch.bfloat16
    )


def test_fp8_relative_error_per_channel_over_a_wide_range():
    """Channels whose magnitudes differ by 10**6 (outlier channels, as keys have) each keep
    e4m3's relative precision: the scale is per channel, not per tensor."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn((2, 2, 3, 64, 8), generator=g)
    kv *= torch.logspace(-3, 3, 8).view(1, 1, 1, 1, 8)
    out = kvformat.decode(kvformat.encode(kv, FP, KEY, "fp8"))[1]
    err = (out - kv).abs()
    assert bool((err <= _fp8_error_bound(kv)).all())
    rel = (err.norm(dim=3) / kv.norm(dim=3)).max()  # per (layer, K/V, head, channel)
    assert rel < 0.04, rel
    # each channel's largest value is the scale's anchor: kept exactly
    amax_pos = kv.abs().argmax(dim=3, keepdim=True)
    assert torch.allclose(out.gather(3, amax_pos), kv.gather(3, amax_pos), rtol=1e-6)


def test_fp8_zero_channels_empty_chunks_and_non_finite_values():
    kv = _kv(shape=(1, 2, 1, 4, 4))
    kv[..., 1] = 0  # an all-zero channel: no division by zero
    out = kvformat.decode(kvformat.encode(kv, FP, KEY, "fp8"))[1]
    assert torch.equal(out[..., 1], torch.zeros_like(out[..., 1]))
    empty = torch.zeros(2, 2, 1, 0, 4)
    assert kvformat.decode(kvformat.encode(empty, FP, KEY, "fp8"))[1].shape == empty.shape
    kv[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ChunkFormatError, match="finite"):
        kvformat.encode(kv, FP, KEY, "fp8")
    with pytest.raises(ChunkFormatError, match="encoding"):
        kvformat.encode(_kv(), FP, KEY, "zstd")


@settings(max_examples=25, deadline=None)
@given(
    st.tuples(*[st.integers(1, 3)] * 2, st.integers(0, 9), st.integers(1, 8)),
    st.sampled_from(["bf16", "fp8"]),
)
def test_encodings_round_trip_any_shape(dims, encoding):
    layers, heads, tokens, head_dim = dims
    kv = torch.randn(layers, 2, heads, tokens, head_dim)
    header, out = kvformat.decode(kvformat.encode(kv, FP, KEY, encoding), FP, key=KEY)
    assert out.shape == kv.shape and header.encoding == encoding
    if tokens:
        bound = _fp8_error_bound(kv) if encoding == "fp8" else kv.abs() / 256
        assert bool(((out - kv).abs() <= bound).all())


def test_a_version_2_chunk_still_decodes_and_none_is_still_written_as_version_2():
    kv = _kv()
    old = _v2_chunk(kv, FP, KEY)
    header, out = kvformat.decode(old, FP, key=KEY)
    assert (header.version, header.encoding) == (2, "none") and torch.equal(out, kv)
    # byte for byte what version-2 writers wrote, so readers that know only v2 keep reading
    assert kvformat.encode(kv, FP, KEY) == old
    assert kvformat.encode(kv.to(torch.bfloat16), FP, KEY, "bf16") == _v2_chunk(
        kv.to(torch.bfloat16), FP, KEY
    )


def test_encoded_chunks_are_version_3_with_the_encoding_in_the_header():
    buf = kvformat.encode(_kv(), FP, KEY, "fp8")
    assert buf[4:6] == b"\x03\x00" and buf[6] == 1 and buf[7] == 2
    assert kvformat.encode(_kv(), FP, KEY, "bf16")[7] == 1


@pytest.mark.parametrize(
    ("version", "code", "match"),
    [
        (3, 7, "encoding"),  # an encoding this reader does not know
        (2, 2, "encoding"),  # version 2 has no encodings
        (4, 2, "version"),  # a newer format
        (1, 0, "version"),
    ],
)
def test_unknown_versions_and_encodings_are_refused_like_corrupt_chunks(version, code, match):
    buf = bytearray(kvformat.encode(_kv(), FP, KEY, "fp8"))
    buf[4:6] = version.to_bytes(2, "little")
    buf[7] = code
    with pytest.raises(ChunkFormatError, match=match):
        kvformat.decode(_reseal(buf), FP, key=KEY)
    from pdserve.store.api import decode_chunk

    assert decode_chunk(bytes(buf), FP, KEY) is None  # readers: a miss


def test_an_encoding_swapped_under_a_valid_header_is_refused():
    """A bf16 chunk relabelled fp8 (header resealed): the payload length no longer matches."""
    buf = bytearray(kvformat.encode(_kv(shape=(1, 2, 1, 8, 4)), FP, KEY, "bf16"))
    buf[7] = 2
    with pytest.raises(ChunkFormatError, match="payload length"):
        kvformat.decode(_reseal(buf), FP)


@pytest.mark.parametrize("offset", [7, 100, HEADER_SIZE, HEADER_SIZE + 5, -1])
def test_any_flipped_byte_of_an_fp8_chunk_is_detected(offset):
    buf = bytearray(kvformat.encode(_kv(), FP, KEY, "fp8"))  # scales first, then values
    buf[offset] ^= 0x01
    with pytest.raises(ChunkFormatError):
        kvformat.decode(buf, FP)


def test_fp8_decoding_is_exact_for_every_e4m3_value():
    """Every finite e4m3 code, each sign, normal and subnormal, decodes to torch's own value
    times the scale (decoding moves bits instead of calling torch's conversion)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F, 0xFF: NaN, never written
    values = codes.view(torch.float8_e4m3fn).float()
    scales = torch.tensor([0.5, 0.5], dtype=torch.float32).view(torch.uint8)  # K, V
    payload = bytearray(torch.cat([scales, codes]).numpy().tobytes())
    out = kvformat._fp8_dequantize(memoryview(payload), (1, 2, 1, 127, 1), torch.float32)
    assert torch.equal(out.reshape(-1), values * 0.5)
