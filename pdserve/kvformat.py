"""The KV chunk codec (docs/architecture.md, "KV chunk format").

A chunk is a fixed 128-byte header followed by raw tensor bytes in the canonical layout
``[layers, 2 (K, V), kv_heads, tokens, head_dim]``, little-endian, C order. No pickle.

Header (little-endian)::

    off  size  field
      0     4  magic b"PDKV"
      4     2  format version (1)
      6     1  dtype code (1 float32, 2 bfloat16, 3 float16)
      7     1  flags (0)
      8    20  shape: 5 x uint32
     28     8  payload length (bytes)
     36    32  model fingerprint digest
     68    16  payload checksum (BLAKE3, first 16 bytes)
     84    16  key digest (BLAKE3 of the store key, first 16 bytes)
    100     8  header checksum (BLAKE3 of bytes 0..100, first 8 bytes)
    108    20  zero padding (keeps the payload 64-byte aligned)

The key digest binds a chunk to the key it was stored under: a whole, valid chunk found under
another key (a late writer's bytes in a reused region, a copy) is refused like a corrupt one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import torch

MAGIC = b"PDKV"
FORMAT_VERSION = 2
HEADER_SIZE = 128
_HEAD = struct.Struct("<4sHBB5IQ32s16s16s")  # bytes 0..100
_HEADER_SUM = struct.Struct("<8s")

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


def encoded_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return HEADER_SIZE + n * torch.empty((), dtype=dtype).element_size()


def _check_tensor(kv: torch.Tensor) -> None:
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ChunkFormatError(
            f"KV tensor must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}"
        )
    if kv.dtype not in DTYPE_CODES:
        raise ChunkFormatError(f"unsupported KV dtype {kv.dtype}")


def encode_into(buf: memoryview | bytearray, kv: torch.Tensor, fingerprint: bytes, key: str) -> int:
    """Writes the chunk for ``kv``, to be stored under ``key``, into ``buf`` (at least
    :func:`encoded_size` bytes); returns the number of bytes written."""
    _check_tensor(kv)
    if len(fingerprint) != 32:
        raise ChunkFormatError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    payload = kv.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
    total = HEADER_SIZE + payload.nbytes
    out = memoryview(buf).cast("B")
    if len(out) < total:
        raise ChunkFormatError(f"buffer of {len(out)} bytes cannot hold a {total}-byte chunk")
    out[HEADER_SIZE:total] = payload.data
    head = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        DTYPE_CODES[kv.dtype],
        0,
        *kv.shape,
        payload.nbytes,
        fingerprint,
        _sum16(out[HEADER_SIZE:total]),
        key_digest(key),
    )
    out[: _HEAD.size] = head
    out[_HEAD.size : _HEAD.size + 8] = _sum16(head)[:8]
    out[_HEAD.size + 8 : HEADER_SIZE] = bytes(HEADER_SIZE - _HEAD.size - 8)
    return total


def encode(kv: torch.Tensor, fingerprint: bytes, key: str) -> bytes:
    buf = bytearray(encoded_size(tuple(kv.shape), kv.dtype))
    encode_into(buf, kv, fingerprint, key)
    return bytes(buf)


def parse_header(buf: memoryview | bytes | bytearray) -> ChunkHeader:
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE:
        raise ChunkFormatError(f"truncated chunk: {len(mv)} bytes is shorter than the header")
    head = bytes(mv[: _HEAD.size])
    magic, version, code, _flags, *rest = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {magic!r}: not a pdserve KV chunk")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if bytes(mv[_HEAD.size : _HEAD.size + 8]) != _sum16(head)[:8]:
        raise ChunkFormatError("header checksum mismatch: the chunk header is corrupt")
    if any(mv[_HEAD.size + 8 : HEADER_SIZE]):
        raise ChunkFormatError("header padding is not zero: the chunk header is corrupt")
    if code not in CODE_DTYPES:
        raise ChunkFormatError(f"unknown dtype code {code}")
    shape = tuple(rest[:5])
    payload_len, fingerprint, checksum, digest = rest[5:]
    return ChunkHeader(CODE_DTYPES[code], shape, payload_len, fingerprint, checksum, digest)  # type: ignore[arg-type]


def decode(
    buf: memoryview | bytes | bytearray,
    expected_fingerprint: bytes | None = None,
    *,
    key: str | None = None,
    verify: bool = True,
) -> tuple[ChunkHeader, torch.Tensor]:
    """Parses and checks a chunk (against ``key`` when given: the key it was read from);
    returns its header and the KV tensor.

    The tensor aliases ``buf`` when it is writable (zero copy) and is a copy otherwise.
    Raises :class:`ChunkFormatError` on a truncated, corrupt or foreign chunk.
    """
    header = parse_header(buf)
    mv = memoryview(buf).cast("B")
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise ChunkFormatError("chunk belongs to a different model fingerprint")
    if key is not None and header.key_digest != key_digest(key):
        raise ChunkFormatError("chunk was stored under another key")
    elem = torch.empty((), dtype=header.dtype).element_size()
    expected_len = elem
    for d in header.shape:
        expected_len *= d
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
    tensor = torch.frombuffer(payload, dtype=torch.uint8).view(header.dtype).view(header.shape)
    return header, tensor
