"""What the pdserve vLLM connector's two halves share: the settings it reads from
``kv_connector_extra_config`` (:class:`ConnectorSettings`, written by :func:`extra_config`),
and the per-step metadata the scheduler half hands the worker half
(:class:`PdserveConnectorMetadata`: the chunks to load into which blocks, the chunks to save
from which blocks). See :mod:`pdserve.engines.vllm_connector` for the flow."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdserve import hashing, identity

log = logging.getLogger("pdserve.engines.vllm_connector")

#: Key of pdserve's entry in a request's ``kv_transfer_params``.
PARAMS_KEY = "pdserve"


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` carries (all JSON-serialisable; the fingerprint in
    its one string form, :meth:`pdserve.hashing.ModelFingerprint.to_labels`)."""

    master_address: str
    fingerprint: hashing.ModelFingerprint
    tail_ttl_ms: int = 30_000
    transport: str = "auto"
    replicas: int = 1
    #: timeout of one store operation (seconds), the engine's ``store_timeout_s``
    timeout_s: float = 5.0
    #: the engine's ``store_backend``: "pdserve", or "mooncake" (a Mooncake Store cluster)
    backend: str = "pdserve"
    #: ``MooncakeStoreClient``'s arguments (``StoreBackendConfig.mooncake_options``)
    backend_options: dict[str, Any] = field(default_factory=dict)
    #: the worker's TLS files (CA, certificate, key paths; empty = plaintext). vLLM runs the
    #: connector in processes of its own, which do not inherit the worker's configured TLS.
    tls_paths: tuple[str, str, str] = ("", "", "")
    #: vLLM's ``kv_role``: kv_both loads and saves, kv_producer only saves, kv_consumer only
    #: loads
    kv_role: str = "kv_both"
    #: MiB of chunk saves the background writer may hold (:mod:`pdserve.engines.save_writer`;
    #: 0 = every save written inside the step)
    save_queue_mib: int = 0
    #: every store load asynchronous: the request waits in ``WAITING_FOR_REMOTE_KVS`` while
    #: its chunks load on a worker-side thread and other requests step (False: stored chunks
    #: load before the step's forward; write mode's loads are asynchronous either way)
    load_async: bool = False

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        return cls(
            master_address=str(extra["master_address"]),
            fingerprint=hashing.ModelFingerprint.from_labels(extra["fingerprint"]),
            tail_ttl_ms=int(extra.get("tail_ttl_ms", 30_000)),
            transport=str(extra.get("transport", "auto")),
            replicas=int(extra.get("replicas", 1)),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            backend=str(extra.get("store_backend", "pdserve")),
            backend_options=dict(extra.get("store_backend_options") or {}),
            save_queue_mib=int(extra.get("save_queue_mib", 0)),
            load_async=bool(extra.get("load_async", False)),
            tls_paths=(
                str(extra.get("tls_ca", "")),
                str(extra.get("tls_cert", "")),
                str(extra.get("tls_key", "")),
            ),
        )

    def make_client(self) -> Any:
        if identity.tls() is None:  # this process is vLLM's: take the worker's identity
            identity.configure_files(identity.TlsFiles.load(*self.tls_paths))
        from pdserve.store import open_store

        if self.backend == "mooncake":
            return open_store(self.master_address, backend="mooncake", **self.backend_options)
        return open_store(self.master_address, transport=self.transport, timeout_s=self.timeout_s)


def extra_config(
    master_address: str,
    fingerprint: hashing.ModelFingerprint,
    *,
    tail_ttl_ms: int = 30_000,
    transport: str = "auto",
    replicas: int = 1,
    timeout_s: float = 5.0,
    backend: str = "pdserve",
    backend_options: dict[str, Any] | None = None,
    tls: identity.TlsFiles | None = None,
    save_queue_mib: int = 0,
    load_async: bool = False,
) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` for :class:`ConnectorSettings.from_extra` (``tls``:
    the worker's TLS files, passed on by path)."""
    ca, cert, key = tls.paths if tls is not None else ("", "", "")
    return {
        "master_address": master_address,
        "fingerprint": fingerprint.to_labels(),
        "tail_ttl_ms": tail_ttl_ms,
        "save_queue_mib": save_queue_mib,
        "load_async": load_async,
        "transport": transport,
        "replicas": replicas,
        "timeout_s": timeout_s,
        "store_backend": backend,
        "store_backend_options": dict(backend_options or {}),
        "tls_ca": ca,
        "tls_cert": cert,
        "tls_key": key,
    }


def log_store_off(reason: str) -> None:
    """The one log line of a connector half that serves without the store."""
    log.error(
        "pdserve KV connector: serving WITHOUT the KV store (no chunk loaded or saved; "
        "vLLM's own prefix cache still works): %s",
        reason,
    )


# ---------------------------------------------------------------------------------------------
# Metadata (scheduler -> worker, one per step)


@dataclass
class ChunkLoad:
    """Store object ``key`` holds tokens ``[start, start + num_tokens)``; write the positions
    ``[skip_before, stop)`` of it (before ``skip_before`` vLLM's local prefix cache has them;
    ``stop < start + num_tokens`` only for the chunk holding the last prompt token)."""

    key: str
    start: int
    num_tokens: int
    skip_before: int
    stop: int


@dataclass
class RequestLoad:
    req_id: str
    block_ids: list[int]
    chunks: list[ChunkLoad]
    #: Write mode: load asynchronously, waiting up to this long for each chunk (ms); 0 = the
    #: chunks are stored already.
    wait_ms: int = 0
    #: The request's W3C trace headers (vLLM's ``trace_headers``; empty = not traced).
    trace: dict[str, str] = field(default_factory=dict)
    #: Loaded off the step, on a worker-side thread, while vLLM parks the request in
    #: ``WAITING_FOR_REMOTE_KVS`` (write mode's loads, and every load with ``load_async``);
    #: False = before this step's forward.
    asynchronous: bool = False


@dataclass
class ChunkSave:
    key: str
    start: int
    num_tokens: int
    block_ids: list[int]
    ttl_ms: int = 0
    #: For the master's KV events: the chain's previous key and the chunk's token ids
    #: (full chunks only; empty tokens = none).
    parent: str = ""
    tokens: list[int] = field(default_factory=list)
    #: vLLM's own hashes of the blocks inside the chunk (``request.block_hashes``), the hash
    #: of the block before them (b"" for the first chunk) and vLLM's block size; empty when
    #: the request has none (no block hasher), so indexers that hash as vLLM does can match.
    engine_hashes: list[bytes] = field(default_factory=list)
    engine_parent: bytes = b""
    engine_block_size: int = 0
    #: The chain root of the request's chain (:func:`pdserve.hashing.chain_root`, hex): the
    #: fingerprint digest, or the digest of its salt and adapter; the master tags the object
    #: with it so ``pdserve kvstore drop`` finds a salt's or an adapter's chunks.
    root: str = ""
    #: The request's tenant ("" = none): the master counts the chunk against its share.
    tenant: str = ""
    #: A reader loads it as soon as the request answers (a P/D prefill's chunks and tail):
    #: written inside the step, never queued (:mod:`pdserve.engines.save_writer`).
    awaited: bool = False


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    #: The W3C trace headers of the traced requests whose chunks are in ``saves``.
    save_traces: list[dict[str, str]] = field(default_factory=list)
