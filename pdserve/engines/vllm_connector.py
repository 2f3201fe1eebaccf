"""The pdserve KV connector for vLLM v1 (loaded with ``kv_connector_module_path``).

It runs inside vLLM's engine core: one instance in the scheduler role, one in the worker role.
Store objects are pdserve chunks (:mod:`pdserve.kvformat`, canonical layout
``[layers, 2, kv_heads, tokens, head_dim]``) under the chain keys of :mod:`pdserve.hashing`,
so the torch engine and this connector read each other's chunks when the fingerprints match.
One chunk is ``chunk_size / block_size`` vLLM blocks. Chunks are written in the fingerprint's
``kv_compression`` encoding and read back in vLLM's KV dtype (an encoded chunk is dequantized
into new memory, then scattered like any other).

Keys are those of the request's cache salt (vLLM's ``Request.cache_salt``, "" = none), so
tenants with different salts never load each other's chunks, as vLLM's own salted block
hashes keep its local prefix cache apart.

Flow per request:

- Scheduler, ``get_num_new_matched_tokens``: the longest stored prefix of the prompt's full
  chunks, capped at ``len(prompt) - 1`` tokens (the last prompt token is always computed): when
  the chunk holding the last prompt token is stored, its first positions are loaded (a prefix
  slice of that chunk), so a fully cached prompt computes one token. Plus the request's partial
  tail when ``kv_transfer_params["pdserve"]["load_tail_key"]`` names one and every chunk before
  it is stored. Loads are synchronous (done before the step's forward), except write mode's.
- Write mode (``kv_transfer_params["pdserve"]["await_chunks"]`` = k, ``["chunk_wait_ms"]``):
  the prompt's first k full chunks are being published by a prefill running at the same time
  on another worker. When the store does not hold them all yet, the lookup answers k chunks
  with ``load_async=True``: vLLM allocates their blocks and parks the request in
  ``WAITING_FOR_REMOTE_KVS``, and the worker side waits for the chunks on a waiter thread
  (:func:`pdserve.engines.chunk_wait.load_as_landed`: each one is scattered into its blocks as
  soon as it is committed, up to ``chunk_wait_ms`` for each) while vLLM's steps go on for
  every other request. The request is reported in ``get_finished`` once every chunk is in, or
  with the blocks of the chunks that did not land in ``get_block_ids_with_load_errors``, which
  vLLM recomputes. Then vLLM schedules it: it computes the rest of the prompt and samples the
  first token itself. A request waits at most once (a failed wait that vLLM reschedules loads
  what is stored, synchronously); an abort stops its wait.
- Worker, ``start_load_kv``: fetches the chunks, verifies them (checksum, fingerprint, shape)
  and scatters them into the request's paged blocks. A chunk that is missing, corrupt or
  unreachable is reported through ``get_block_ids_with_load_errors``; with
  ``kv_load_failure_policy="recompute"`` vLLM then recomputes from the first failed block, so
  a failed load costs time, never a wrong token.
- Scheduler, ``build_connector_meta``: tracks each request's prompt progress and emits a save
  for every prompt chunk completed in this step (and the partial tail under
  ``save_tail_key`` once the whole prompt is computed).
- Worker, ``wait_for_save`` (called synchronously at the end of every step, after the
  forward): gathers each chunk's blocks across layers into the canonical layout and writes it
  (skipping keys that already exist). When a request's output leaves the engine, its chunks
  are committed in the store.
- Scheduler, ``request_finished``: returns ``{"pdserve": {"loaded_tokens", "failed_tokens"}}``
  as the request's ``kv_transfer_params`` (visible on vLLM's ``RequestOutput``).

The partial tail is stored with its exact token count (the last vLLM block partially
filled): vLLM accepts non-block-aligned external token counts, so decode loads the whole
original prompt and computes only the position of the first generated token.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import re
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from pdserve import hashing, identity, telemetry
from pdserve.engines import kv_layout
from pdserve.engines.chunk_io import ChunkIO
from pdserve.kvformat import DTYPE_NAMES, encoded_size
from pdserve.store.api import ChunkMeta

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger(__name__)

#: Key of pdserve's entry in a request's ``kv_transfer_params``.
PARAMS_KEY = "pdserve"
DEFAULT_STORE_CLIENT = "pdserve.store.client.StoreClient"


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` carries (all JSON-serialisable)."""

    master_address: str
    fingerprint: hashing.ModelFingerprint
    tail_ttl_ms: int = 30_000
    transport: str = "auto"
    store_client: str = DEFAULT_STORE_CLIENT
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

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        return cls(
            master_address=str(extra["master_address"]),
            fingerprint=hashing.ModelFingerprint(
                model_id=str(extra["model_id"]),
                revision=str(extra.get("revision", "")),
                kv_dtype=str(extra.get("kv_dtype", "float32")),
                chunk_size=int(extra["chunk_size"]),
                kv_compression=str(extra.get("kv_compression", "none")),
                tp_size=int(extra.get("tp_size", 1)),
            ),
            tail_ttl_ms=int(extra.get("tail_ttl_ms", 30_000)),
            transport=str(extra.get("transport", "auto")),
            store_client=str(extra.get("store_client", DEFAULT_STORE_CLIENT)),
            replicas=int(extra.get("replicas", 1)),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            backend=str(extra.get("store_backend", "pdserve")),
            backend_options=dict(extra.get("store_backend_options") or {}),
            tls_paths=(
                str(extra.get("tls_ca", "")),
                str(extra.get("tls_cert", "")),
                str(extra.get("tls_key", "")),
            ),
        )

    def make_client(self) -> Any:
        if identity.tls() is None:  # this process is vLLM's: take the worker's identity
            identity.configure_files(identity.TlsFiles.load(*self.tls_paths))
        if self.backend == "mooncake":
            from pdserve.store import open_store

            return open_store(self.master_address, backend="mooncake", **self.backend_options)
        module, _, name = self.store_client.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(self.master_address, transport=self.transport, timeout_s=self.timeout_s)


def extra_config(
    master_address: str,
    fingerprint: hashing.ModelFingerprint,
    *,
    tail_ttl_ms: int = 30_000,
    transport: str = "auto",
    store_client: str = DEFAULT_STORE_CLIENT,
    replicas: int = 1,
    timeout_s: float = 5.0,
    backend: str = "pdserve",
    backend_options: dict[str, Any] | None = None,
    tls: identity.TlsFiles | None = None,
) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` for :class:`ConnectorSettings.from_extra` (``tls``:
    the worker's TLS files, passed on by path)."""
    ca, cert, key = tls.paths if tls is not None else ("", "", "")
    return {
        "master_address": master_address,
        "model_id": fingerprint.model_id,
        "revision": fingerprint.revision,
        "kv_dtype": fingerprint.kv_dtype,
        "chunk_size": fingerprint.chunk_size,
        "kv_compression": fingerprint.kv_compression,
        "tp_size": fingerprint.tp_size,
        "tail_ttl_ms": tail_ttl_ms,
        "transport": transport,
        "store_client": store_client,
        "replicas": replicas,
        "timeout_s": timeout_s,
        "store_backend": backend,
        "store_backend_options": dict(backend_options or {}),
        "tls_ca": ca,
        "tls_cert": cert,
        "tls_key": key,
    }


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
    #: Write mode: load asynchronously, waiting up to this long for each chunk (ms); 0 = a
    #: synchronous load of stored chunks before this step's forward.
    wait_ms: int = 0


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


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Scheduler-side state


@dataclass
class _LoadPlan:
    start: int  # tokens vLLM already has locally (block aligned)
    end: int  # tokens available after the load (<= len(prompt) - 1)
    keys: list[str]  # stored chunk keys covering [0, len(keys) * chunk_size), maybe past end
    tail_key: str  # "" when the plan ends on a chunk boundary
    block_ids: list[int] = field(default_factory=list)
    wait_ms: int = 0  # write mode: the keys may still be landing (an asynchronous load)


@dataclass
class _SaveTracker:
    keys: list[str]
    prompt_len: int
    prompt: list[int]
    tail_key: str
    block_ids: list[int]
    computed: int = 0
    next_chunk: int = 0
    tail_done: bool = False


@dataclass
class _Outcome:
    planned: int = 0  # tokens the load plan covered (beyond the local prefix cache)
    plan_start: int = 0
    block_ids: list[int] = field(default_factory=list)
    failed_from: int | None = None  # first token position that failed to load
    chunks: int = 0  # chunks the plan loads (an asynchronous load: saved by their writer)


def _request_params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None) or {}
    inner = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    return inner if isinstance(inner, dict) else {}


def _cache_salt(request: Any) -> str:
    """The request's cache salt ("" = none): vLLM's ``Request.cache_salt``, which the engine
    sets from the prompt's ``cache_salt`` (and which salts vLLM's own block hashes)."""
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) else ""


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[-1]) if found else 0


@dataclass
class StoreMetricStats(KVConnectorStats):
    """The connector's store metric updates (:func:`pdserve.telemetry.drain_relay`) on
    their way from vLLM's engine core to the worker's process, where the engine's stat logger
    replays them into the metrics its ``/metrics`` serves. ``data``: ``{"updates": [...]}``."""

    def reset(self) -> None:
        self.data = {"updates": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data.setdefault("updates", []).extend(other.data.get("updates", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"store_metric_updates": len(self.data.get("updates", []))}

    def is_empty(self) -> bool:
        return not self.data.get("updates")


class PdserveConnector(KVConnectorBase_V1):
    """Loads and saves pdserve KV chunks between the pdserve store and vLLM's paged cache."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # This process's registry is not served: the store metrics go to the worker's.
        telemetry.start_relay()
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = ConnectorSettings.from_extra(extra)
        self.fp = self.settings.fingerprint
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_size = self.fp.chunk_size
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a multiple of vLLM's block size "
                f"{self.block_size}"
            )
        self.blocks_per_chunk = self.chunk_size // self.block_size
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != self.fp.tp_size:
            raise ValueError(
                f"the connector's fingerprint is for tp_size {self.fp.tp_size}, vLLM runs {tp}"
            )
        #: Keys: the scheduler's are rank 0's (the chain); a worker of TP rank r > 0 stores and
        #: reads its share under ``hashing.rank_key`` of them, with its rank's fingerprint.
        self.rank_fp = self.fp
        if role == KVConnectorRole.WORKER and tp > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank_fp = replace(self.fp, tp_rank=get_tensor_model_parallel_rank())
        #: the store, reached only through ChunkIO (one failure policy with the torch engine)
        self.io = ChunkIO(
            self.settings.make_client(), self.rank_fp, replicas=self.settings.replicas
        )
        #: why this engine serves without the store ("" = it uses it): a KV layout the
        #: connector cannot convert. Each role derives it (the scheduler from the config, the
        #: worker from its caches), so neither plans nor moves a chunk in a layout it would
        #: read or write wrong.
        self._off_reason = ""
        #: the worker's caches' layout (kv_layout), set in register_kv_caches
        self._layout: kv_layout.BlockLayout | None = None
        if role == KVConnectorRole.SCHEDULER:
            model = vllm_config.model_config
            try:
                kv_layout.engine_layout(
                    vllm_config, model.dtype, self.block_size, model.get_head_size()
                )
            except kv_layout.LayoutError as exc:
                self._store_off(str(exc))
        # scheduler role
        self._plans: dict[str, _LoadPlan] = {}
        self._trackers: dict[str, _SaveTracker] = {}
        self._outcomes: dict[str, _Outcome] = {}
        self._requests: dict[str, Request] = {}
        #: leading prompt chunks the store held at each waiting request's last lookup: a
        #: request need not save them again (its local prefix-cache hit is not loaded, and
        #: without this every later request on a cached prefix gathered and encoded the whole
        #: prefix again, inside its step, for the master to skip it)
        self._stored: dict[str, int] = {}
        #: write mode: asynchronous loads allocated, for the next metadata; requests that
        #: have had their one wait
        self._async_plans: dict[str, _LoadPlan] = {}
        self._waited: set[str] = set()
        # worker role
        self._caches: list[torch.Tensor] = []
        self._failed_blocks: set[int] = set()
        #: write mode's waiter threads: the stop event of each wait in progress, the requests
        #: whose wait ended (for get_finished); ``_lock`` guards these and _failed_blocks
        self._lock = threading.Lock()
        self._waits: dict[str, threading.Event] = {}
        self._landed: set[str] = set()
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        self._arena = bytearray()
        self._arena_tensor = torch.empty(0, dtype=torch.uint8)

    # ------------------------------------------------------------------ scheduler side

    def _store_off(self, reason: str) -> None:
        """Serve without the store from now on (logged once): vLLM computes every prompt
        and keeps its own prefix cache; nothing is loaded or saved."""
        if not self._off_reason:
            log.error(
                "pdserve KV connector: serving WITHOUT the KV store (no chunk loaded or "
                "saved; vLLM's own prefix cache still works): %s",
                reason,
            )
        self._off_reason = reason

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._off_reason:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        limit = len(tokens) - 1  # the last prompt token is always computed
        cs = self.chunk_size
        params = _request_params(request)
        keys = hashing.chunk_keys(self.fp, tokens, _cache_salt(request))
        # a store that fails answers no hit (ChunkIO): vLLM computes everything
        hit = self.io.lookup(keys)
        self._stored[request.request_id] = hit
        # a stored chunk holding the last token is loaded up to that token (a prefix slice)
        end = min(hit * cs, limit)
        tail_key = str(params.get("load_tail_key", ""))
        tail_end = int(params.get("load_tail_tokens", 0))
        use_tail = (
            bool(tail_key)
            and cs * (tail_end // cs) == end
            and end < tail_end <= limit
            and self.io.has(tail_key)
        )
        if use_tail:
            end = tail_end
        else:
            tail_key = ""
        awaited = min(int(params.get("await_chunks", 0)), limit // cs)
        wait_ms = int(params.get("chunk_wait_ms", 0))
        if (
            hit < awaited
            and wait_ms > 0
            and num_computed_tokens < awaited * cs
            and request.request_id not in self._waited
        ):
            # write mode: the chunks are still landing; vLLM parks the request meanwhile
            self._plans[request.request_id] = _LoadPlan(
                start=num_computed_tokens,
                end=awaited * cs,
                keys=keys[:awaited],
                tail_key="",
                wait_ms=wait_ms,
            )
            return awaited * cs - num_computed_tokens, True
        if end <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = _LoadPlan(
            start=num_computed_tokens, end=end, keys=keys[:hit], tail_key=tail_key
        )
        return end - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        if num_external_tokens <= 0:
            del self._plans[request.request_id]
            return
        # The scheduler may trim a sub-block local hit: re-derive where the load starts.
        plan.start = plan.end - num_external_tokens
        plan.block_ids = list(blocks.get_block_ids()[0])
        if plan.wait_ms:  # parked in WAITING_FOR_REMOTE_KVS: not in this step's new requests
            self._waited.add(request.request_id)
            self._async_plans[request.request_id] = self._plans.pop(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PdserveConnectorMetadata()
        if self._off_reason:
            return meta
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._plans.pop(req_id, None)
            self._stored.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._trackers.pop(req_id, None)
        for req_id, plan in self._async_plans.items():
            meta.loads.append(self._load_meta(req_id, plan, plan.block_ids))
            self._outcomes[req_id] = _Outcome(
                planned=plan.end - plan.start,
                plan_start=plan.start,
                block_ids=plan.block_ids,
                chunks=len(plan.keys),
            )
        self._async_plans.clear()

        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.pop(new.req_id, None)
            block_ids = list(new.block_ids[0])
            # chunks the store holds: not saved again (a local prefix-cache hit's included)
            loaded_chunks = self._stored.pop(new.req_id, 0)
            if plan is not None:
                meta.loads.append(self._load_meta(new.req_id, plan, block_ids))
                loaded_chunks = len(plan.keys)
                self._outcomes[new.req_id] = _Outcome(
                    planned=plan.end - plan.start, plan_start=plan.start, block_ids=block_ids
                )
            elif new.req_id in self._outcomes:  # its asynchronous load is over
                done = self._outcomes[new.req_id]
                failed = done.failed_from
                loaded_chunks = done.chunks if failed is None else failed // self.chunk_size
            self._track(new.req_id, new.prompt_token_ids or [], block_ids, loaded_chunks)
            self._advance(
                new.req_id,
                new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                meta,
            )

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
            self._advance(
                req_id,
                cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id],
                meta,
            )
        return meta

    def _load_meta(self, req_id: str, plan: _LoadPlan, block_ids: list[int]) -> RequestLoad:
        cs = self.chunk_size
        chunks = [
            ChunkLoad(key, i * cs, cs, plan.start, min((i + 1) * cs, plan.end))
            for i, key in enumerate(plan.keys)
            if (i + 1) * cs > plan.start
        ]
        if plan.tail_key:
            base = len(plan.keys) * cs
            chunks.append(ChunkLoad(plan.tail_key, base, plan.end - base, plan.start, plan.end))
        return RequestLoad(req_id, block_ids, chunks, plan.wait_ms)

    def _track(
        self, req_id: str, prompt: list[int], block_ids: list[int], loaded_chunks: int
    ) -> None:
        request = self._requests.get(req_id)
        params = _request_params(request)
        self._trackers[req_id] = _SaveTracker(
            keys=hashing.chunk_keys(self.fp, prompt, _cache_salt(request)),
            prompt_len=len(prompt),
            prompt=prompt,
            tail_key=str(params.get("save_tail_key", "")),
            block_ids=block_ids,
            next_chunk=loaded_chunks,
        )

    def _advance(self, req_id: str, computed: int, meta: PdserveConnectorMetadata) -> None:
        """Emits saves for the prompt chunks (and tail) that ``computed`` tokens complete."""
        tracker = self._trackers[req_id]
        tracker.computed = computed
        cs, bs = self.chunk_size, self.block_size
        done = min(computed, tracker.prompt_len) // cs
        for i in range(tracker.next_chunk, done):
            blocks = tracker.block_ids[i * self.blocks_per_chunk : (i + 1) * self.blocks_per_chunk]
            parent = tracker.keys[i - 1] if i else ""
            tokens = list(tracker.prompt[i * cs : (i + 1) * cs])
            meta.saves.append(ChunkSave(tracker.keys[i], i * cs, cs, blocks, 0, parent, tokens))
        tracker.next_chunk = max(tracker.next_chunk, done)
        if tracker.tail_key and not tracker.tail_done and computed >= tracker.prompt_len:
            start = len(tracker.keys) * cs
            n = tracker.prompt_len - start
            if n > 0:
                blocks = tracker.block_ids[start // bs : (tracker.prompt_len + bs - 1) // bs]
                meta.saves.append(
                    ChunkSave(tracker.tail_key, start, n, blocks, self.settings.tail_ttl_ms)
                )
            tracker.tail_done = True

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        bs = self.block_size
        for outcome in self._outcomes.values():
            first = outcome.plan_start // bs
            last = (outcome.plan_start + outcome.planned + bs - 1) // bs
            for idx in range(first, min(last, len(outcome.block_ids))):
                if outcome.block_ids[idx] in invalid:
                    pos = idx * bs
                    if outcome.failed_from is None or pos < outcome.failed_from:
                        outcome.failed_from = pos
                    break

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._stored.pop(req_id, None)
        self._async_plans.pop(req_id, None)
        self._waited.discard(req_id)
        outcome = self._outcomes.pop(req_id, _Outcome())
        failed = 0
        if outcome.failed_from is not None:
            failed = (
                outcome.plan_start + outcome.planned - max(outcome.failed_from, outcome.plan_start)
            )
        return False, {
            PARAMS_KEY: {"loaded_tokens": outcome.planned - failed, "failed_tokens": failed}
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        self._caches = [kv_caches[n] for n in names]
        dtype = DTYPE_NAMES.get(self._caches[0].dtype)
        if dtype != self.fp.kv_dtype:
            raise ValueError(
                f"vLLM's KV cache dtype {self._caches[0].dtype} does not match the "
                f"fingerprint's kv_dtype {self.fp.kv_dtype!r}"
            )
        cache = self._caches[0]
        try:
            self._layout = kv_layout.engine_layout(
                self._vllm_config, cache.dtype, int(cache.shape[2]), int(cache.shape[3]) // 2
            )
            self._layout.views(cache)  # checks the cache's shape and strides against it
        except kv_layout.LayoutError as exc:
            self._store_off(str(exc))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        for load in meta.loads:
            if self._off_reason:  # planned by a scheduler that could convert: recompute it
                with self._lock:
                    if load.chunks:
                        self._failed_blocks.update(self._blocks_from(load, 0))
                    if load.wait_ms:
                        self._landed.add(load.req_id)
            elif load.wait_ms:
                self._start_wait(load)
            else:
                self._load_request(load)

    def _start_wait(self, load: RequestLoad) -> None:
        """Write mode: hands ``load`` to a waiter thread (see the module docstring)."""
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(
                4, thread_name_prefix="pdserve-kv-wait"
            )
        stop = threading.Event()
        with self._lock:
            self._waits[load.req_id] = stop
        self._waiter.submit(self._await_load, load, stop)

    def _await_load(self, load: RequestLoad, stop: threading.Event) -> None:
        """Waiter thread: scatters each chunk of ``load`` as it lands. The request's blocks
        are its own until it is reported finished, so this writes them while vLLM's forwards
        use others. The chunks are read into fresh buffers, not the forward thread's arena.
        Chunks that did not land (or were corrupt) are reported as failed blocks before the
        request is reported finished, as vLLM requires."""
        keys = [self._rank_key(c.key) for c in load.chunks]
        loaded = 0

        def land(start: int, end: int) -> int:
            nonlocal loaded
            tensors = self.io.get(keys[start:end])
            good = []
            for chunk, kv in zip(load.chunks[start:end], tensors, strict=True):
                if not self._valid(kv, chunk.num_tokens):
                    break
                good.append((chunk, kv))
            self._scatter_all(good, load.block_ids)  # type: ignore[arg-type]
            loaded += len(good)
            return len(good)

        self.io.load_as_landed(keys, load.wait_ms, land, stop.is_set)
        with self._lock:
            if loaded < len(load.chunks) and not stop.is_set():
                self._failed_blocks.update(self._blocks_from(load, loaded))
                log.warning(
                    "pdserve chunk %d of %s did not land in %d ms: recomputing from it",
                    loaded,
                    load.req_id,
                    load.wait_ms,
                )
            del self._waits[load.req_id]
            self._landed.add(load.req_id)

    def _blocks_from(self, load: RequestLoad, index: int) -> list[int]:
        """The blocks ``load`` fills from its chunk ``index`` on (recomputed on a failure)."""
        bs = self.block_size
        chunk = load.chunks[index]
        first = max(chunk.start, chunk.skip_before) // bs
        last = (load.chunks[-1].stop + bs - 1) // bs
        return load.block_ids[first:last]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write mode: the requests whose wait ended since the last call; a finished (aborted)
        request's wait is stopped, and reported here once its thread has let go of its
        blocks (vLLM frees them then)."""
        with self._lock:
            for req_id in finished_req_ids:
                stop = self._waits.get(req_id)
                if stop is not None:
                    stop.set()
            landed, self._landed = self._landed, set()
        return None, landed or None

    def _load_request(self, load: RequestLoad) -> None:
        bs = self.block_size
        tensors = self.io.get(
            [self._rank_key(c.key) for c in load.chunks], arena=self._arena_for(load)
        )
        loaded: list[tuple[ChunkLoad, torch.Tensor]] = []
        for i, (chunk, kv) in enumerate(zip(load.chunks, tensors, strict=True)):
            if not self._valid(kv, chunk.num_tokens):
                first = max(chunk.start, chunk.skip_before) // bs
                with self._lock:
                    self._failed_blocks.update(self._blocks_from(load, i))
                log.warning(
                    "pdserve chunk %d of %s missing or corrupt: recomputing from token %d",
                    i,
                    load.req_id,
                    first * bs,
                )
                break
            assert kv is not None
            loaded.append((chunk, kv))
        self._scatter_all(loaded, load.block_ids)

    def _arena_for(self, load: RequestLoad) -> memoryview:
        """The reusable read buffer, grown to hold every chunk of ``load`` (the chunks are
        scattered into the paged cache before the next load reuses it)."""
        cache = self._caches[0]
        layers, heads, dim = len(self._caches), cache.shape[1], self._layout.head_dim
        need = sum(
            encoded_size((layers, 2, heads, c.num_tokens, dim), cache.dtype, self.fp.kv_compression)
            for c in load.chunks
        )
        if len(self._arena) < need:
            self._arena = bytearray(need)
            self._arena_tensor = torch.frombuffer(self._arena, dtype=torch.uint8)
        return memoryview(self._arena)

    def _valid(self, kv: torch.Tensor | None, num_tokens: int) -> bool:
        if kv is None or not self._caches:
            return False
        heads, dim = self._caches[0].shape[1], self._layout.head_dim
        expected = (len(self._caches), 2, heads, num_tokens, dim)
        return tuple(kv.shape) == expected and kv.dtype == self._caches[0].dtype

    def _scatter_all(
        self, loaded: list[tuple[ChunkLoad, torch.Tensor]], block_ids: list[int]
    ) -> None:
        """Writes loaded chunks into their paged blocks. Chunks written whole go in one
        indexed copy per layer and K/V for all of them (per-block copies cost more in call
        overhead than in bytes: 3,840 of them for a 2k-token prompt); the partial blocks at
        the edges (local-cache overlap, the last prompt token) one by one."""
        bs = self.block_size
        whole: dict[tuple[int, ...], list[tuple[ChunkLoad, torch.Tensor]]] = {}
        for chunk, kv in loaded:
            begin, end = max(chunk.start, chunk.skip_before), chunk.stop
            whole_blocks = chunk.num_tokens % bs == 0  # not a request's partial tail
            if whole_blocks and begin == chunk.start and end == chunk.start + chunk.num_tokens:
                whole.setdefault(tuple(kv.shape), []).append((chunk, kv))
            else:
                self._scatter(kv, chunk, block_ids)
        for shape, group in whole.items():
            per = shape[3] // bs  # blocks per chunk (chunk sizes are multiples of bs)
            src = self._stacked([kv for _, kv in group])  # [n, L, 2, H, t, D]
            idx = torch.tensor(
                [[block_ids[c.start // bs + j] for j in range(per)] for c, _ in group],
                device=self._caches[0].device,
            )
            layout = self._layout
            for layer, cache in enumerate(self._caches):
                for part, view in enumerate(layout.views(cache)):
                    # [n, H, t, D] -> [n, per, H, bs, D] in the layout's axes, a view: one
                    # index_put per layer and part
                    blocks = src[:, layer, part].unflatten(2, (per, bs)).transpose(1, 2)
                    view[idx] = layout.factor(blocks, part).to(cache.device)

    def _stacked(self, kvs: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(kvs)``, without the copy when the chunks lie evenly spaced in the
        read arena (as the store client reads them): a strided view of it."""
        first = kvs[0]
        base = self._arena_tensor
        esize = first.element_size()
        start = base.data_ptr()
        offsets = [kv.data_ptr() - start for kv in kvs]
        step = offsets[1] - offsets[0] if len(kvs) > 1 else 0
        if (
            len(kvs) > 1
            and step > 0
            and offsets[0] >= 0
            and offsets[0] % esize == 0
            and step % esize == 0
            and offsets[-1] + first.nbytes <= base.numel()
            and len(base) % esize == 0
            and all(kv.is_contiguous() for kv in kvs)
            and all(o == offsets[0] + i * step for i, o in enumerate(offsets))
        ):
            return base.view(first.dtype).as_strided(
                (len(kvs), *first.shape),
                (step // esize, *first.stride()),
                offsets[0] // esize,
            )
        return torch.stack(kvs)

    def _scatter(self, kv: torch.Tensor, chunk: ChunkLoad, block_ids: list[int]) -> None:
        """Writes the positions ``[max(start, skip_before), stop)`` of one chunk, block by
        block. A block written in part is read, patched and written back whole (a layout may
        interleave neighbouring tokens); its other positions are recomputed by vLLM later."""
        bs = self.block_size
        begin, end = max(chunk.start, chunk.skip_before), chunk.stop
        for b in range(begin // bs, (end + bs - 1) // bs):
            lo, hi = max(b * bs, begin), min((b + 1) * bs, end)
            src = kv[:, :, :, lo - chunk.start : hi - chunk.start, :]  # [L, 2, H, t, D]
            for layer, cache in enumerate(self._caches):
                ids = torch.tensor([block_ids[b]], device=cache.device)
                block = self._layout.gather(cache, ids)  # [1, 2, H, bs, D]
                block[0, :, :, lo - b * bs : hi - b * bs] = src[layer]
                self._layout.scatter(cache, ids, block)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Saves read the registered caches once per step in wait_for_save.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        if not meta.saves or self._off_reason or not self.io.available():
            return
        # one batched put per TTL (prompt chunks; request tails): two master round trips per
        # step whatever the chunk count, and existing keys skipped by the master, no pre-check
        by_ttl: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for save, kv in zip(meta.saves, self._gather_all(meta.saves), strict=True):
            by_ttl.setdefault(save.ttl_ms, []).append((self._rank_key(save.key), kv))
        # KV events describe the chain (rank 0's keys: H(parent || tokens)); other ranks' keys
        # are derived, not chained, and carry none
        chain = {
            s.key: ChunkMeta(s.parent, s.tokens, s.num_tokens)
            for s in meta.saves
            if s.tokens and self.rank_fp.tp_rank == 0
        }
        for ttl_ms, items in by_ttl.items():
            self.io.save(items, ttl_ms=ttl_ms, meta=chain)  # a chunk not saved: a future miss

    def _gather_all(self, saves: list[ChunkSave]) -> list[torch.Tensor]:
        """Each save's KV ``[layers, 2, kv_heads, tokens, head_dim]``. The full chunks of a
        step are gathered together (:meth:`_gather_blocks`: one indexed copy per layer and K
        or V for all of them; one chunk at a time cost about 1.2 ms each for SmolLM2's 30
        layers, a 512-token prompt's 16 chunks about 20 ms inside the step, together about
        4.5 ms); a partial tail alone."""
        bpc, cs = self.blocks_per_chunk, self.chunk_size
        full = [i for i, s in enumerate(saves) if s.num_tokens == cs and len(s.block_ids) >= bpc]
        out: list[torch.Tensor | None] = [None] * len(saves)
        if full:
            together = self._gather_blocks([saves[i].block_ids[:bpc] for i in full])
            for j, i in enumerate(full):
                out[i] = together[j]
        return [kv if kv is not None else self._gather(s) for kv, s in zip(out, saves, strict=True)]

    def _gather(self, save: ChunkSave) -> torch.Tensor:
        """One save's KV ``[layers, 2, kv_heads, num_tokens, head_dim]``, contiguous."""
        nblocks = (save.num_tokens + self.block_size - 1) // self.block_size
        kv = self._gather_blocks([save.block_ids[:nblocks]])[0]
        return kv[:, :, :, : save.num_tokens].contiguous()

    def _gather_blocks(self, block_lists: list[list[int]]) -> torch.Tensor:
        """The KV of each list of blocks (all of one length ``nb``), in the chunk layout:
        ``[lists, layers, 2, kv_heads, nb * block_size, head_dim]``, one indexed copy per
        layer and K or V for all the lists, each list's slice contiguous."""
        n, nb = len(block_lists), len(block_lists[0])
        layout, first = self._layout, self._caches[0]
        heads, bs, dim = first.shape[1], self.block_size, layout.head_dim
        ids = [b for blocks in block_lists for b in blocks]
        index = torch.tensor(ids, dtype=torch.long, device=first.device)
        # on the host: the store reads and writes host memory
        out = torch.empty((n, len(self._caches), 2, heads, nb * bs, dim), dtype=first.dtype)
        for layer, cache in enumerate(self._caches):
            for half, view in enumerate(layout.views(cache)):
                blocks = view.index_select(0, index)  # [n * nb, H, t_hi, t_lo, d_hi, d_lo]
                dst = out[:, layer, half].view(n, heads, nb, bs, dim).transpose(1, 2)
                layout.factor(dst, half).copy_(blocks.view(n, nb, *blocks.shape[1:]))
        return out

    def _rank_key(self, key: str) -> str:
        """Where this worker's TP rank keeps its share of the chunk rank 0 keeps at ``key``."""
        return hashing.rank_key(key, self.rank_fp)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The store metric updates of this process since the last call (vLLM asks both
        roles every step; in one process the first takes them all)."""
        updates = telemetry.drain_relay()
        return StoreMetricStats(data={"updates": updates}) if updates else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return StoreMetricStats(data={"updates": list((data or {}).get("updates", []))})

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        with self._lock:
            for stop in self._waits.values():
                stop.set()
        if self._waiter is not None:
            self._waiter.shutdown(wait=True, cancel_futures=True)
        self.io.close()
