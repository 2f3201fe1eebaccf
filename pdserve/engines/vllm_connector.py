"""The pdserve KV connector for vLLM v1 (loaded with ``kv_connector_module_path``).

It runs inside vLLM's engine core: one instance in the scheduler role, one in the worker role.
As vLLM's own store connectors, it is a thin dispatcher: each role's state and logic live in a
plain class, :class:`~pdserve.engines.connector_scheduler.ConnectorScheduler` and
:class:`~pdserve.engines.connector_worker.ConnectorWorker`, which unit tests drive without an
engine; what they share (settings, per-step metadata) is :mod:`pdserve.engines.connector_data`.
Store objects are pdserve chunks (:mod:`pdserve.kvformat`, canonical layout
``[layers, 2, kv_heads, tokens, head_dim]``) under the chain keys of :mod:`pdserve.hashing`,
so the torch engine and this connector read each other's chunks when the fingerprints match.
One chunk is ``chunk_size / block_size`` vLLM blocks. Chunks are written in the fingerprint's
``kv_compression`` encoding and read back in vLLM's KV dtype (an encoded chunk is dequantized
into new memory, then scattered like any other).

Keys are those of the request's cache salt (vLLM's ``Request.cache_salt``, "" = none) and
LoRA adapter (its name and content digest), so tenants with different salts and requests
through different adapters (or none) never load each other's chunks, as vLLM's own block
hashes keep its local prefix cache apart. Requests with multimodal inputs or prompt
embeddings, and those whose ``kv_transfer_params["pdserve"]["bypass_store"]`` is true, bypass
the store: no lookup, load or save (:mod:`pdserve.engines.connector_keys`).

Flow per request:

- Scheduler, ``get_num_new_matched_tokens``: the longest stored prefix of the prompt's full
  chunks, capped at ``len(prompt) - 1`` tokens (the last prompt token is always computed): when
  the chunk holding the last prompt token is stored, its first positions are loaded (a prefix
  slice of that chunk), so a fully cached prompt computes one token. Plus the request's partial
  tail when ``kv_transfer_params["pdserve"]["load_tail_key"]`` names one and every chunk before
  it is stored. Loads are synchronous (done before the step's forward), except write mode's
  and, with ``load_async`` (``store_load_async``: on by default on a GPU), every load: the
  lookup answers ``load_async=True``, vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``
  and the worker side loads its stored chunks on a waiter thread while vLLM's steps go on
  for every other request, as in write mode below (with no wait: the chunks are stored).
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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from pdserve import hashing, telemetry, tracing
from pdserve.engines import kv_layout
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import (
    PARAMS_KEY,
    ConnectorSettings,
    PdserveConnectorMetadata,
    extra_config,
)
from pdserve.engines.connector_scheduler import ConnectorScheduler
from pdserve.engines.connector_stock import settings_from_vllm
from pdserve.engines.connector_worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["PARAMS_KEY", "ConnectorSettings", "PdserveConnector", "extra_config"]


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
    """Loads and saves pdserve KV chunks between the pdserve store and vLLM's paged cache:
    vLLM's connector interface, dispatched to the role's half."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # This process's registry is not served: the store metrics go to the worker's.
        telemetry.start_relay()
        # the worker's (or vllm serve's) OTLP endpoint: its store spans join the requests'
        tracing.configure_from_env("pdserve-vllm")
        settings = settings_from_vllm(vllm_config)
        fp = settings.fingerprint
        block_size = vllm_config.cache_config.block_size
        if fp.chunk_size % block_size:
            raise ValueError(
                f"chunk_size {fp.chunk_size} must be a multiple of vLLM's block size {block_size}"
            )
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != fp.tp_size:
            raise ValueError(
                f"the connector's fingerprint is for tp_size {fp.tp_size}, vLLM runs {tp}"
            )
        #: Keys: the scheduler's are rank 0's (the chain); a worker of TP rank r > 0 stores and
        #: reads its share under ``hashing.rank_key`` of them, with its rank's fingerprint.
        rank_fp = fp
        if role == KVConnectorRole.WORKER and tp > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank_fp = replace(fp, tp_rank=get_tensor_model_parallel_rank())
        #: the store, reached only through ChunkIO (one failure policy with the torch engine)
        self.io = ChunkIO(settings.make_client(), rank_fp, replicas=settings.replicas)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # the scheduler plans no chunk in a layout its workers would convert wrong: the
            # same derivation as theirs, from the config
            off = kv_layout.config_layout_error(vllm_config)
            self._scheduler = ConnectorScheduler(settings, block_size, self.io, off)
        else:
            self._worker = ConnectorWorker(
                vllm_config, fp, rank_fp, block_size, self.io, settings.save_queue_mib
            )

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker role"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker-side call on the scheduler role"
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        self.worker.start_load_kv(meta)

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
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------------ both

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

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` reaches the store: every
        chunk of this engine's fingerprint is dropped (each TP rank's: every rank tags its
        chunks with rank 0's fingerprint, :attr:`ChunkIO.labels`), when the engine's identity
        may (admin; :meth:`ChunkIO.drop` logs why not and this answers False)."""
        return self.io.drop([self.io.labels[hashing.DIGEST_LABEL]])

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self.io.close()
