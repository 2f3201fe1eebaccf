"""What every store backend offers (pdserve's own store, or a Mooncake Store cluster), and the
KV-chunk helpers they share.

Backends implement the raw-object methods; ``put_chunk`` / ``get_chunk`` /
``batch_get_chunks`` encode and verify :mod:`pdserve.kvformat` chunks on top of them. A chunk
that fails verification is a miss and counts in ``pdserve_store_corrupt_chunks_total``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from pdserve import errors, kvformat
from pdserve.telemetry import REGISTRY, Relayed
from pdserve.v1 import kvstore_pb2

if TYPE_CHECKING:
    import torch

CORRUPT_CHUNKS = Relayed(
    "store_corrupt_chunks",
    Counter(
        "pdserve_store_corrupt_chunks_total",
        "KV chunks that failed verification (checksum, header or fingerprint) on every replica",
        registry=REGISTRY,
    ),
)


@dataclass(frozen=True)
class StoreOptions:
    """Per-put options."""

    replicas: int = 1
    soft_pin: bool = False
    ttl_ms: int = 0
    #: Record a BLAKE3 checksum of the bytes with the object, so every read verifies them
    #: (a torn write or a late writer's bytes read as a miss, never as data). Off for objects
    #: that carry their own check: KV chunks (checksum and key in their header).
    checksum: bool = True

    def validate(self) -> None:
        if self.replicas < 1:
            raise errors.InvalidArgument(f"replicas must be >= 1, got {self.replicas}")
        if self.ttl_ms < 0:
            raise errors.InvalidArgument(f"ttl_ms must be >= 0, got {self.ttl_ms}")


@dataclass(frozen=True)
class ChunkMeta:
    """What a KV chunk is in its prompt's chain, attached to its put so the master can
    publish it with the chunk's stored event (``KVBlockMeta``; docs/architecture.md, "KV
    events"). Backends that cannot carry it (memory, Mooncake) ignore it."""

    #: Key of the chain's previous chunk ("" for the first chunk).
    parent: str
    #: The chunk's token ids.
    tokens: Sequence[int]
    #: Tokens per chunk (0 = ``len(tokens)``).
    block_size: int = 0
    #: Where the chunk lives, as vLLM names media ("" = the master's default, CPU).
    medium: str = ""
    #: The engine's own hashes of the blocks inside the chunk, in order (vLLM's
    #: ``request.block_hashes``; () = none), for indexers that hash prompts as the engine
    #: does; the hash of the engine block before the chunk's first (b"" for the first chunk)
    #: and the engine's block size (tokens per hash; 0 = none).
    engine_hashes: Sequence[bytes] = ()
    engine_parent: bytes = b""
    engine_block_size: int = 0

    def packed_tokens(self) -> bytes:
        """The token ids as uint32 little-endian."""
        import array
        import sys

        a = array.array("I", self.tokens)
        if sys.byteorder == "big":
            a.byteswap()
        return a.tobytes()


@dataclass(frozen=True)
class ChunkNamespace:
    """Whose KV a put's chunks are (``KVNamespace``; docs/kvstore.md, "Namespaces"): the
    model fingerprint (digest hex and labels, ``ModelFingerprint.to_labels()``) and each
    chunk's chain root (:func:`pdserve.hashing.chain_root`, hex). The master tags the objects
    with it, so ``pdserve kvstore drop`` finds a model's (or a cache salt's) chunks and a
    quarantine hides them. Backends that cannot carry it (memory, Mooncake) ignore it."""

    #: The fingerprint's digest (64 hex characters).
    fingerprint: str
    #: The fingerprint's labels.
    labels: Mapping[str, str]
    #: key -> its chain root (hex); a key not here has the fingerprint's digest as its root
    #: (no cache salt, no adapter).
    roots: Mapping[str, str] = field(default_factory=dict)
    #: chain root -> the tenant whose requests write under it (KVNamespace.tenant; a root not
    #: here: no tenant).
    tenants: Mapping[str, str] = field(default_factory=dict)

    def root_of(self, key: str) -> str:
        return self.roots.get(key) or self.fingerprint


#: The default per-put options (one replica, no pin, no TTL).
DEFAULT_OPTIONS = StoreOptions()


class NotEnoughNodes(errors.Unavailable):
    """The master answered that too few storage nodes are alive to place a put (a node died,
    or a master that has just taken over waits for the nodes to remount). Unavailable like
    the store's other failures, but the master is reachable and answering: not a reason to
    leave the store alone for a while (:mod:`pdserve.engines.chunk_io`)."""


#: The exception a backend raises for a failed item's KVErrorCode: the one table, for the
#: pdserve master's per-item codes and (mapped onto these codes) Mooncake's return codes.
#: Any other code is the store's failure, not the caller's: Unavailable.
_KV_ERRORS: dict[int, type[errors.PdserveError]] = {
    kvstore_pb2.KV_INVALID: errors.InvalidArgument,
    kvstore_pb2.KV_NOT_FOUND: errors.NotFound,
    kvstore_pb2.KV_NO_SPACE: errors.ResourceExhausted,
    kvstore_pb2.KV_NOT_ENOUGH_NODES: NotEnoughNodes,
}


def kv_error(code: int | None, what: str, detail: str = "") -> errors.PdserveError:
    """The exception for ``what`` (e.g. ``"put of 'k'"``) failing with KVErrorCode ``code``
    (None: a failure with no KVErrorCode, such as an unknown Mooncake return code)."""
    if code is None:
        return errors.Unavailable(f"{what} failed: {detail}")
    message = f"{what}: {kvstore_pb2.KVErrorCode.Name(code)}" + (f": {detail}" if detail else "")
    return _KV_ERRORS.get(code, errors.Unavailable)(message)


def check_keys(keys: Sequence[str]) -> list[str]:
    """The keys as a list; InvalidArgument unless each is a non-empty string."""
    if isinstance(keys, str):
        raise errors.InvalidArgument("keys must be a sequence of strings, not one string")
    out = list(keys)
    for k in out:
        if not isinstance(k, str) or not k:
            raise errors.InvalidArgument(f"every key must be a non-empty string, got {k!r}")
    return out


def byte_view(data: Any, *, writable: bool = False, allow_empty: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``data``; InvalidArgument when it is not a contiguous
    (writable, when asked) buffer, or empty unless ``allow_empty``."""
    try:
        mv = memoryview(data)
    except TypeError as exc:
        raise errors.InvalidArgument(
            f"expected a bytes-like buffer, got {type(data).__name__}"
        ) from exc
    if not mv.c_contiguous:
        raise errors.InvalidArgument("the buffer must be contiguous")
    if writable and mv.readonly:
        raise errors.InvalidArgument("the buffer must be writable")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if not allow_empty and len(mv) == 0:
        raise errors.InvalidArgument("data must not be empty (objects have size > 0)")
    return mv


class StoreBackend(ABC):
    """The store client API (docs/architecture.md, "KV store"). Thread-safe. Read failures are
    misses (None), never exceptions; invalid input raises InvalidArgument, an unreachable
    master Unavailable, no space ResourceExhausted."""

    #: Whether :meth:`batch_put` takes ``meta=`` (per-key :class:`ChunkMeta`) and
    #: ``namespace=`` (:class:`ChunkNamespace`); the others get neither, and
    #: :meth:`batch_put_chunks` drops them for them.
    carries_chunk_meta = False

    def put(
        self, key: str, data: bytes | memoryview, options: StoreOptions = DEFAULT_OPTIONS
    ) -> bool:
        """True = written now, False = the key already existed (idempotent no-op)."""
        return self.batch_put([(key, data)], options)[0]

    @abstractmethod
    def batch_put(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        options: StoreOptions = DEFAULT_OPTIONS,
    ) -> list[bool]: ...

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss (absent, unreachable or failed read)."""
        return self.batch_get([key])[0]

    @abstractmethod
    def get_into(self, key: str, buf: memoryview) -> int | None:
        """Bytes written into ``buf``, or None on a miss."""

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """:meth:`get_into` for each key and its buffer (backends batch the lookups)."""
        if len(buffers) != len(keys):
            raise errors.InvalidArgument(
                f"batch_get_into: {len(keys)} keys but {len(buffers)} buffers"
            )
        return [self.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` exist."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> int:
        """Removed count (absent or leased objects are not removed)."""

    @abstractmethod
    def close(self) -> None: ...

    def put_chunk(
        self,
        key: str,
        kv: torch.Tensor,
        fingerprint: bytes,
        options: StoreOptions = DEFAULT_OPTIONS,
        *,
        encoding: str = "none",
    ) -> bool:
        return self.batch_put_chunks([(key, kv)], fingerprint, options, encoding=encoding)[0]

    def batch_put_chunks(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        fingerprint: bytes,
        options: StoreOptions = DEFAULT_OPTIONS,
        *,
        encoding: str = "none",
        meta: Mapping[str, ChunkMeta] | None = None,
        namespace: ChunkNamespace | None = None,
    ) -> list[bool]:
        """Encodes each chunk (with the chunk ``encoding`` of :mod:`pdserve.kvformat`, the
        fingerprint's ``kv_compression``) and puts them all with one :meth:`batch_put` (one
        master round trip per phase, whatever the count; existing keys are skipped, no
        pre-check). Readers need no encoding: the chunk's header names it. ``meta``: the
        chunks' places in their chains, for the KV events; ``namespace``: whose KV they are
        (both where the backend carries them)."""
        try:
            encoded = [(key, kvformat.encode(kv, fingerprint, key, encoding)) for key, kv in items]
        except kvformat.ChunkFormatError as exc:
            raise errors.InvalidArgument(str(exc)) from exc
        options = replace(options, checksum=False)
        if (meta or namespace) and self.carries_chunk_meta:
            return self.batch_put(encoded, options, meta=meta, namespace=namespace)  # type: ignore[call-arg]
        return self.batch_put(encoded, options)

    def get_chunk(self, key: str, fingerprint: bytes) -> torch.Tensor | None:
        return self.batch_get_chunks([key], fingerprint)[0]

    def batch_get_chunks(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[torch.Tensor | None]:
        """Verified chunks; a corrupt or foreign chunk (or one stored under another key) is a
        miss (counted)."""
        out: list[torch.Tensor | None] = []
        for key, data in zip(keys, self.batch_get(keys), strict=True):
            tensor = decode_chunk(data, fingerprint, key) if data is not None else None
            if data is not None and tensor is None:
                CORRUPT_CHUNKS.inc()
            out.append(tensor)
        return out

    def __enter__(self) -> StoreBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_chunk(
    data: bytes | bytearray | memoryview, fingerprint: bytes, key: str
) -> torch.Tensor | None:
    """The verified tensor of the chunk read from ``key``, or None when it is corrupt,
    foreign, or was stored under another key."""
    try:
        return kvformat.decode(data, fingerprint, key=key)[1]
    except kvformat.ChunkFormatError:
        return None
