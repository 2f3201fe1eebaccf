"""The KV chunk codec (docs/architecture.md, "KV chunk format").

A chunk is a fixed 128-byte header followed by the KV of the canonical layout
``[layers, 2 (K, V), kv_heads, tokens, head_dim]``, little-endian, C order, in one of the
encodings below. No pickle.

Header (little-endian)::

    off  size  field
      0     4  magic b"PDKV"
      4     2  format version (2 or 3)
      6     1  dtype code (1 float32, 2 bfloat16, 3 float16): the KV's dtype, what readers get
      7     1  encoding code (version 3; 0 in version 2): how the payload stores the KV
      8    20  shape: 5 x uint32
     28     8  payload length (bytes)
     36    32  model fingerprint digest
     68    16  payload checksum (BLAKE3, first 16 bytes)
     84    16  key digest (BLAKE3 of the store key, first 16 bytes)
    100     8  header checksum (BLAKE3 of bytes 0..100, first 8 bytes)
    108    20  zero padding (keeps the payload 64-byte aligned)

The key digest binds a chunk to the key it was stored under: a whole, valid chunk found under
another key (a late writer's bytes in a reused region, a copy) is refused like a corrupt one.

Encodings (the payload; the checksum covers it as stored):

- 0 ``none``: the tensor's raw bytes.
- 1 ``bf16``: the tensor as bfloat16 (half the bytes of float32 KV; of bfloat16 KV it is the
  same bytes, so such a chunk is written as ``none``).
- 2 ``fp8``: float8 e4m3 (``torch.float8_e4m3fn``) with per-channel scales: one float32 scale
  per (layer, K/V, kv_head, head_dim channel) over the chunk's tokens, ``amax / 448``; the
  payload is the scales ``[layers, 2, kv_heads, head_dim]`` then the fp8 values in the
  canonical layout. A value keeps e4m3's precision relative to itself (3 mantissa bits:
  error <= 1/16 of its magnitude) down to ``2**-6 / 448`` of its channel's max; below that
  (e4m3 subnormals) its error is at most ``2**-10 / 448`` of the channel's max.

Readers decode to the header's dtype (dequantizing). Version 3 added the encoding byte: a
chunk with encoding ``none`` is still written as version 2, byte for byte what version-2
writers wrote, so readers that know only version 2 keep reading uncompressed chunks; every
version this module knows is read. An unknown version or encoding is refused like a corrupt
chunk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import torch

MAGIC = b"PDKV"
#: The newest format version (written for encoded chunks; ``none`` chunks are version 2).
FORMAT_VERSION = 3
#: Versions this module reads.
VERSIONS = (2, 3)
HEADER_SIZE = 128
_HEAD = struct.Struct("<4sHBB5IQ32s16s16s")  # bytes 0..100
_HEADER_SUM = struct.Struct("<8s")

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: Encoding codes (header byte 7): a wire format, never renumbered. Names as in
#: :data:`pdserve.hashing.KV_COMPRESSIONS`.
ENCODING_CODES = {"none": 0, "bf16": 1, "fp8": 2}
CODE_ENCODINGS = {v: k for k, v in ENCODING_CODES.items()}
#: Largest finite float8 e4m3fn value: a channel's max maps onto it.
FP8_MAX = 448.0


class ChunkFormatError(ValueError):
    """A buffer is not a valid KV chunk: bad magic/version, truncated, corrupt or foreign."""


@dataclass(frozen=True)
class ChunkHeader:
    dtype: torch.dtype
    shape: tuple[int, int, int, int, int]
    payload_len: int
    fingerprint: bytes
    checksum: bytes
    key_digest: bytes
    encoding: str = "none"
    version: int = FORMAT_VERSION

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + self.payload_len


def _sum16(data: memoryview | bytes) -> bytes:
    return blake3.blake3(data).digest(length=16)


def key_digest(key: str) -> bytes:
    """What a chunk's header records of the key it is stored under."""
    return _sum16(key.encode())


def stored_encoding(dtype: torch.dtype, encoding: str) -> str:
    """The encoding a chunk of ``dtype`` KV asked to be ``encoding`` is written with:
    ``bf16`` of bfloat16 KV stores the same bytes as ``none``, and is written as such."""
    if encoding not in ENCODING_CODES:
        raise ChunkFormatError(
            f"unknown chunk encoding {encoding!r}: use one of {tuple(ENCODING_CODES)}"
        )
    return "none" if encoding == "bf16" and dtype == torch.bfloat16 else encoding


def _payload_len(shape: tuple[int, ...], dtype: torch.dtype, encoding: str) -> int:
    n = 1
    for d in shape:
        n *= d
    if encoding == "bf16":
        return 2 * n
    if encoding == "fp8":
        layers, two, heads, _tokens, dim = shape
        return 4 * layers * two * heads * dim + n
    return n * torch.empty((), dtype=dtype).element_size()


def encoded_size(shape: tuple[int, ...], dtype: torch.dtype, encoding: str = "none") -> int:
    """Bytes of the chunk of a ``shape`` KV tensor of ``dtype`` written with ``encoding``."""
    return HEADER_SIZE + _payload_len(shape, dtype, stored_encoding(dtype, encoding))


def _fp8_quantize(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales ``[layers, 2, kv_heads, head_dim]`` (float32) and the fp8 values of
    ``kv`` (as uint8 bytes, canonical layout)."""
    x = kv.float()
    if x.shape[3] == 0:
        scales = torch.ones(x.shape[:3] + x.shape[4:], dtype=torch.float32)
    else:
        scales = x.abs().amax(dim=3) / FP8_MAX
        if not bool(torch.isfinite(scales).all()):
            raise ChunkFormatError("fp8 encoding needs finite KV values")
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (x / scales.unsqueeze(3)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return scales.contiguous(), q.view(torch.uint8)


def _fp8_dequantize(
    payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    layers, two, heads, tokens, dim = shape
    if tokens == 0:
        return torch.empty(shape, dtype=dtype)
    split = 4 * layers * two * heads * dim
    scales = torch.frombuffer(payload[:split], dtype=torch.uint8).view(torch.float32)
    # e4m3 -> float16 by moving bits, exact for every finite e4m3 value (subnormals included)
    # and about 8x faster than torch's float8 conversion on CPU: the sign-extended byte shifted
    # left by 7 puts sign, exponent and mantissa where float16 keeps them; the exponent bias
    # (15 instead of 7) goes into the scale (x 2**8).
    bits = torch.frombuffer(payload[split:], dtype=torch.int8).to(torch.int16)
    bits <<= 7
    bits &= -0x4001  # bit 14 holds a copy of the sign: float16's exponent starts with 0
    half = bits.view(torch.float16).view(shape)
    return (half * (scales.view(layers, two, heads, 1, dim) * 256.0)).to(dtype)


def _check_tensor(kv: torch.Tensor) -> None:
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ChunkFormatError(
            f"KV tensor must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}"
        )
    if kv.dtype not in DTYPE_CODES:
        raise ChunkFormatError(f"unsupported KV dtype {kv.dtype}")


def encode_into(
    buf: memoryview | bytearray,
    kv: torch.Tensor,
    fingerprint: bytes,
    key: str,
    encoding: str = "none",
) -> int:
    """Writes the chunk for ``kv``, to be stored under ``key`` with ``encoding`` (see the
    module docstring), into ``buf`` (at least :func:`encoded_size` bytes); returns the number
    of bytes written."""
    _check_tensor(kv)
    if len(fingerprint) != 32:
        raise ChunkFormatError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    encoding = stored_encoding(kv.dtype, encoding)
    kv = kv.detach().cpu()
    if encoding == "fp8":
        parts = list(_fp8_quantize(kv))
    elif encoding == "bf16":
        parts = [kv.to(torch.bfloat16)]
    else:
        parts = [kv]
    arrays = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in parts]
    nbytes = sum(a.nbytes for a in arrays)
    total = HEADER_SIZE + nbytes
    out = memoryview(buf).cast("B")
    if len(out) < total:
        raise ChunkFormatError(f"buffer of {len(out)} bytes cannot hold a {total}-byte chunk")
    pos = HEADER_SIZE
    for a in arrays:
        out[pos : pos + a.nbytes] = a.data
        pos += a.nbytes
    head = _HEAD.pack(
        MAGIC,
        2 if encoding == "none" else FORMAT_VERSION,
        DTYPE_CODES[kv.dtype],
        ENCODING_CODES[encoding],
        *kv.shape,
        nbytes,
        fingerprint,
        _sum16(out[HEADER_SIZE:total]),
        key_digest(key),
    )
    out[: _HEAD.size] = head
    out[_HEAD.size : _HEAD.size + 8] = _sum16(head)[:8]
    out[_HEAD.size + 8 : HEADER_SIZE] = bytes(HEADER_SIZE - _HEAD.size - 8)
    return total


def encode(kv: torch.Tensor, fingerprint: bytes, key: str, encoding: str = "none") -> bytes:
    _check_tensor(kv)
    buf = bytearray(encoded_size(tuple(kv.shape), kv.dtype, encoding))
    encode_into(buf, kv, fingerprint, key, encoding)
    return bytes(buf)


def parse_header(buf: memoryview | bytes | bytearray) -> ChunkHeader:
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE:
        raise ChunkFormatError(f"truncated chunk: {len(mv)} bytes is shorter than the header")
    head = bytes(mv[: _HEAD.size])
    magic, version, code, enc, *rest = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {magic!r}: not a pdserve KV chunk")
    if version not in VERSIONS:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if bytes(mv[_HEAD.size : _HEAD.size + 8]) != _sum16(head)[:8]:
        raise ChunkFormatError("header checksum mismatch: the chunk header is corrupt")
    if any(mv[_HEAD.size + 8 : HEADER_SIZE]):
        raise ChunkFormatError("header padding is not zero: the chunk header is corrupt")
    if code not in CODE_DTYPES:
        raise ChunkFormatError(f"unknown dtype code {code}")
    if enc not in CODE_ENCODINGS or (version == 2 and enc != 0):
        raise ChunkFormatError(f"unknown encoding code {enc} in a version {version} chunk")
    shape = tuple(rest[:5])
    payload_len, fingerprint, checksum, digest = rest[5:]
    return ChunkHeader(
        CODE_DTYPES[code],
        shape,  # type: ignore[arg-type]
        payload_len,
        fingerprint,
        checksum,
        digest,
        CODE_ENCODINGS[enc],
        version,
    )


def decode(
    buf: memoryview | bytes | bytearray,
    expected_fingerprint: bytes | None = None,
    *,
    key: str | None = None,
    verify: bool = True,
) -> tuple[ChunkHeader, torch.Tensor]:
    """Parses and checks a chunk (against ``key`` when given: the key it was read from);
    returns its header and the KV tensor, in the header's dtype (an encoded chunk is
    dequantized).

    An unencoded chunk's tensor aliases ``buf`` when it is writable (zero copy) and is a copy
    otherwise; an encoded chunk's is always new memory. Raises :class:`ChunkFormatError` on a
    truncated, corrupt or foreign chunk, or one of an unknown version or encoding.
    """
    header = parse_header(buf)
    mv = memoryview(buf).cast("B")
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise ChunkFormatError("chunk belongs to a different model fingerprint")
    if key is not None and header.key_digest != key_digest(key):
        raise ChunkFormatError("chunk was stored under another key")
    expected_len = _payload_len(header.shape, header.dtype, header.encoding)
    if header.payload_len != expected_len:
        raise ChunkFormatError(
            f"payload length {header.payload_len} does not match shape {header.shape}"
        )
    if len(mv) < header.total_size:
        raise ChunkFormatError(f"truncated chunk: {len(mv)} bytes, header says {header.total_size}")
    payload = mv[HEADER_SIZE : header.total_size]
    if verify and _sum16(payload) != header.checksum:
        raise ChunkFormatError("payload checksum mismatch: the chunk is corrupt")
    if payload.readonly:
        payload = memoryview(bytearray(payload))
    if not payload:
        return header, torch.empty(header.shape, dtype=header.dtype)
    if header.encoding == "fp8":
        return header, _fp8_dequantize(payload, header.shape, header.dtype)
    stored = torch.bfloat16 if header.encoding == "bf16" else header.dtype
    tensor = torch.frombuffer(payload, dtype=torch.uint8).view(stored).view(header.shape)
    return header, tensor.to(header.dtype)
