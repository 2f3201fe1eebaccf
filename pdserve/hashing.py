"""Chunking and chain hashing of token prefixes (docs/architecture.md, "Keys").

``h_0 = H(model fingerprint)``, ``h_i = H(h_{i-1} || chunk_i tokens as uint32 LE)`` with H =
BLAKE3-256. Keys depend only on the model fingerprint, the tokens and the request's cache
salt, so they are identical across processes, hosts and restarts (never Python's ``hash()``).

A cache salt (a tenant's secret, vLLM's ``cache_salt``) changes only the root (see
:func:`chain_root`): ``h_0 = H(model fingerprint || u32 LE byte length of the salt || the
salt as UTF-8)``, so a salted chain shares no key with the unsalted one or another salt's,
and requests without a salt keep the keys they always had.

A chunk encoding (``kv_compression``: the KV stored as bf16 or fp8, :mod:`pdserve.kvformat`)
is part of the fingerprint, so workers that store different numerics never share a key: it
goes into the KV dtype field of the canonical encoding (``"float32+fp8"``), which keeps the
encoding's structure (and so every uncompressed key) unchanged.

Tensor parallelism: each TP rank holds its share of the KV heads and stores it as its own
chunk. The chain is that of the fingerprint of rank 0 (``tp_rank = 0``, ``tp_size = n``: TP
keys never equal single-engine keys), which is what schedulers and routers look up; rank
``r > 0`` stores chunk ``k`` under :func:`rank_key` ``(k)``, derived from the rank-0 key alone,
so every rank finds its share from the keys the scheduler hands out.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import blake3
import numpy as np

#: Version of the canonical KV layout ``[layers, 2, kv_heads, tokens, head_dim]``.
LAYOUT_VERSION = 1
DIGEST_BYTES = 32
KV_DTYPES = ("float32", "bfloat16", "float16")
#: How chunks store the KV (:mod:`pdserve.kvformat`): as computed, as bfloat16, or as float8
#: e4m3 with per-channel scales.
KV_COMPRESSIONS = ("none", "bf16", "fp8")
MAX_TOKEN_ID = 2**32 - 1
#: The label of a fingerprint's digest (hex) in :meth:`ModelFingerprint.to_labels`.
DIGEST_LABEL = "fingerprint"


def _h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that changes the bytes of a KV chunk. Two workers share cache entries
    exactly when their fingerprints are equal."""

    model_id: str
    revision: str = ""
    kv_dtype: str = "float32"
    chunk_size: int = 256
    layout_version: int = LAYOUT_VERSION
    tp_rank: int = 0
    tp_size: int = 1
    #: The chunk encoding (:data:`KV_COMPRESSIONS`); ``bf16`` of bfloat16 KV would store the
    #: same bytes as ``none``, so it is refused: resolve it to ``none`` first.
    kv_compression: str = "none"
    #: Runtime options that change the KV (vLLM's ``quantization``, ``hf_overrides``, ...):
    #: sorted ``name=value`` pairs joined by ``;``, built only by
    #: :func:`pdserve.model.kv_options.kv_options`; ``""`` when none is set.
    options: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(
                f"kv_compression must be one of {KV_COMPRESSIONS}, got {self.kv_compression!r}"
            )
        if self.kv_compression == "bf16" and self.kv_dtype == "bfloat16":
            raise ValueError("kv_compression bf16 of bfloat16 KV is a no-op: use none")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")

    def canonical(self) -> bytes:
        """Unambiguous byte encoding: length-prefixed strings, fixed-width integers. The KV
        dtype field reads ``"<kv_dtype>+<kv_compression>"`` when chunks are compressed (never
        a valid dtype, so no compressed fingerprint equals an uncompressed one), else just the
        dtype: uncompressed keys are those stored before compression existed. Options, when
        set, follow the integers as ``b"options" || u32 LE length || options``; without them
        the encoding is the one fingerprints had before options existed."""
        stored = self.kv_dtype
        if self.kv_compression != "none":
            stored = f"{self.kv_dtype}+{self.kv_compression}"
        parts = [
            b"pdserve-kv",
            self.model_id.encode(),
            self.revision.encode(),
            stored.encode(),
        ]
        head = b"".join(struct.pack("<I", len(p)) + p for p in parts)
        tail = struct.pack(
            "<IIII", self.layout_version, self.chunk_size, self.tp_rank, self.tp_size
        )
        if self.options:
            options = self.options.encode()
            tail += b"options" + struct.pack("<I", len(options)) + options
        return head + tail

    def to_labels(self) -> dict[str, str]:
        """The fingerprint as strings, the one form every process writes it in (a worker's
        registration labels with meta, which the router reads; the vLLM connector's extra
        config): every field (``kv_options`` only when set), and the digest (hex) under
        ``"fingerprint"``.
        :meth:`from_labels` reads it back."""
        labels = {
            DIGEST_LABEL: self.digest().hex(),
            "model_id": self.model_id,
            "model_revision": self.revision,
            "kv_dtype": self.kv_dtype,
            "chunk_size": str(self.chunk_size),
            "kv_compression": self.kv_compression,
            "kv_layout": str(self.layout_version),
            "tp": f"{self.tp_rank}/{self.tp_size}",
        }
        if self.options:
            labels["kv_options"] = self.options
        return labels

    @classmethod
    def from_labels(cls, labels: Mapping[str, str], *, model_id: str = "") -> ModelFingerprint:
        """The fingerprint :meth:`to_labels` wrote. ``kv_dtype`` and ``chunk_size`` are
        required; ``model_id`` defaults to the argument, the others to the field defaults
        (a worker that registers no ``kv_compression`` stores uncompressed chunks, one with no
        ``kv_options`` runs without options). The
        digest label is not read: it follows from the fields. Raises ValueError naming the
        field that is missing or invalid."""
        for name in ("kv_dtype", "chunk_size"):
            if not labels.get(name):
                raise ValueError(f"fingerprint label {name!r} is missing")
        rank, sep, size = labels.get("tp", "0/1").partition("/")
        try:
            chunk_size = int(labels["chunk_size"])
            layout = int(labels.get("kv_layout", LAYOUT_VERSION))
            tp_rank, tp_size = int(rank), int(size if sep else "")
        except ValueError as exc:
            raise ValueError(f"fingerprint labels: a number is not one: {exc}") from None
        return cls(
            model_id=labels.get("model_id", model_id),
            revision=labels.get("model_revision", ""),
            kv_dtype=labels["kv_dtype"],
            chunk_size=chunk_size,
            layout_version=layout,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kv_compression=labels.get("kv_compression", "none"),
            options=labels.get("kv_options", ""),
        )

    def digest(self) -> bytes:
        """``h_0``: the 32-byte root of every chain for this model."""
        return _h(self.canonical())


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4").tobytes()


def num_full_chunks(num_tokens: int, chunk_size: int) -> int:
    return num_tokens // chunk_size


def chain_root(fingerprint: ModelFingerprint, cache_salt: str = "", adapter: str = "") -> bytes:
    """``h_0`` of a request's chain: the fingerprint digest without a salt or an adapter
    (both ``""``); with a salt only, ``H(fingerprint.canonical() || u32 LE len(salt bytes) ||
    salt bytes)``, salt bytes = the salt as UTF-8 (the keys salted requests always had); with
    an adapter (its identity, :func:`pdserve.model.fingerprint.adapter_identity`: a LoRA's
    name and content hash), ``H(fingerprint.canonical() || u32 len(salt) || salt || b"adapter"
    || u32 len(adapter) || adapter)``. The canonical encoding is self-delimiting, so no
    salted or adapted input equals another's."""
    if not cache_salt and not adapter:
        return fingerprint.digest()
    salt = cache_salt.encode("utf-8")
    head = fingerprint.canonical() + struct.pack("<I", len(salt)) + salt
    if adapter:
        name = adapter.encode("utf-8")
        head += b"adapter" + struct.pack("<I", len(name)) + name
    return _h(head)


def chain_hashes(root: bytes, tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """Digests of every *full* chunk of ``tokens``, chained from ``root`` (:func:`chain_root`)."""
    if len(root) != DIGEST_BYTES:
        raise ValueError(f"root must be {DIGEST_BYTES} bytes, got {len(root)}")
    raw = tokens_to_bytes(tokens)
    step = 4 * chunk_size
    out: list[bytes] = []
    prev = root
    for i in range(num_full_chunks(len(raw) // 4, chunk_size)):
        prev = _h(prev + raw[i * step : (i + 1) * step])
        out.append(prev)
    return out


def chunk_keys(
    fingerprint: ModelFingerprint,
    tokens: Sequence[int] | np.ndarray,
    cache_salt: str = "",
    adapter: str = "",
) -> list[str]:
    """Store keys (64 hex chars) of the full chunks of ``tokens``, in prompt order, in the
    chain of ``cache_salt`` ("" = no salt) and ``adapter`` ("" = the base model):
    :func:`chain_root`."""
    root = chain_root(fingerprint, cache_salt, adapter)
    return [h.hex() for h in chain_hashes(root, tokens, fingerprint.chunk_size)]


def rank_key(key: str, fingerprint: ModelFingerprint) -> str:
    """The key under which TP rank ``fingerprint.tp_rank`` stores its share of the chunk (or
    tail) that rank 0 stores under ``key``: ``key`` itself on rank 0, else ``"tp-"`` + H(
    ``key`` as UTF-8 || u32 LE rank || u32 LE size), hex."""
    if fingerprint.tp_rank == 0:
        return key
    rank = struct.pack("<II", fingerprint.tp_rank, fingerprint.tp_size)
    return "tp-" + _h(key.encode() + rank).hex()


def tail_key(
    fingerprint: ModelFingerprint,
    tokens: Sequence[int] | np.ndarray,
    request_id: str,
    cache_salt: str = "",
    adapter: str = "",
) -> str:
    """Request-scoped key for the partial last chunk ("" when the prompt ends on a boundary).

    It covers the whole chain before the tail (salted and adapted like the chunks), the tail tokens and
    the request id, so two requests never share a tail object.
    """
    n = len(tokens)
    cs = fingerprint.chunk_size
    full = num_full_chunks(n, cs)
    if full * cs == n:
        return ""
    root = chain_root(fingerprint, cache_salt, adapter)
    chain = chain_hashes(root, tokens[: full * cs], cs)
    prev = chain[-1] if chain else root
    rid = request_id.encode()
    return (
        "tail-"
        + _h(prev + struct.pack("<I", len(rid)) + rid + tokens_to_bytes(tokens[full * cs :])).hex()
    )
