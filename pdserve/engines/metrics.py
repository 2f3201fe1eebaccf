"""Engine metrics, defined once so that every engine implementation (and the KV connector)
shares them in :data:`pdserve.telemetry.REGISTRY`. The store metrics are
:class:`~pdserve.telemetry.Relayed`: the vLLM engine's KV connector updates them inside vLLM's
engine-core process, and they reach the worker's ``/metrics`` from there."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pdserve.telemetry import REGISTRY, Relayed, init_labels

#: Store operations that failed (master unreachable, timeout, no space): the engine went on
#: without the store, recomputing what it could not load. ``op``: lookup|load|save.
STORE_OPS = ("lookup", "load", "save")
CHUNK_KINDS = ("chunk", "tail")
#: Why the vLLM connector left a request out of the store (:mod:`pdserve.engines.connector_keys`).
BYPASS_REASONS = ("requested", "multimodal", "prompt_embeds", "adapter_unreadable")

KV_STORE_ERRORS = Relayed(
    "kv_store_errors",
    Counter(
        "pdserve_kv_store_errors_total",
        "KV store operations that failed; the engine recomputed instead",
        ["op"],
        registry=REGISTRY,
    ),
)
#: Time of the store operations that succeeded (``pdserve.engines.chunk_io``). ``op``:
#: lookup|load|save.
KV_STORE_SECONDS = Relayed(
    "kv_store_seconds",
    Histogram(
        "pdserve_kv_store_op_seconds",
        "Time of one engine store operation (a batched lookup, read or save)",
        ["op"],
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        registry=REGISTRY,
    ),
)
#: 1 while the engine serves without the store: vLLM handed it a KV cache layout the
#: connector cannot convert (:mod:`pdserve.engines.kv_layout`; the reason is in the worker's
#: log and ``pdserve status``). vLLM's own prefix cache still works.
KV_STORE_OFF = Gauge(
    "pdserve_kv_store_off",
    "1 while this engine serves without the KV store (a KV layout it cannot convert)",
    registry=REGISTRY,
)
#: Prompt tokens whose KV came from the store. ``phase``: prefill|decode.
KV_LOADED_TOKENS = Counter(
    "pdserve_kv_loaded_tokens_total",
    "Prompt tokens whose KV was loaded from the store",
    ["phase"],
    registry=REGISTRY,
)
#: Prompt tokens the engine computed. ``reason``: uncached (prefill of new tokens), local
#: (decode prefilled a prompt without a KV handle), kv_miss (a handle pointed to a missing,
#: corrupt or mismatched chunk), store_error (the store failed).
KV_COMPUTED_TOKENS = Counter(
    "pdserve_kv_computed_tokens_total",
    "Prompt tokens whose KV the engine computed",
    ["reason"],
    registry=REGISTRY,
)
#: Chunks a handle or prefix lookup promised but that could not be used (missing, corrupt,
#: wrong shape). ``kind``: chunk|tail.
KV_CHUNK_MISSES = Relayed(
    "kv_chunk_misses",
    Counter(
        "pdserve_kv_chunk_misses_total",
        "KV chunks that were expected in the store but missing or invalid when loaded",
        ["kind"],
        registry=REGISTRY,
    ),
)
KV_CHUNKS_WRITTEN = Relayed(
    "kv_chunks_written",
    Counter(
        "pdserve_kv_chunks_written_total",
        "KV chunks written to the store (kind: chunk|tail)",
        ["kind"],
        registry=REGISTRY,
    ),
)
#: Steps whose chunk saves waited for room in the background writer's queue
#: (:mod:`pdserve.engines.save_writer`): the store was slower than the engine.
KV_SAVE_QUEUE_WAITS = Relayed(
    "kv_save_queue_waits",
    Counter(
        "pdserve_kv_save_queue_waits_total",
        "Engine steps that waited for room in the KV save queue (the store slower than the engine)",
        registry=REGISTRY,
    ),
)
KV_CHUNKS_SKIPPED = Relayed(
    "kv_chunks_skipped",
    Counter(
        "pdserve_kv_chunks_skipped_total",
        "Full KV chunks not written because the store already held them",
        registry=REGISTRY,
    ),
)
#: Requests the vLLM connector neither looked up, loaded nor saved (vLLM computed them), by
#: ``reason`` (:data:`BYPASS_REASONS`).
KV_STORE_BYPASSED = Relayed(
    "kv_store_bypassed",
    Counter(
        "pdserve_kv_store_bypassed_requests_total",
        "Requests that bypassed the KV store (computed, neither loaded nor saved)",
        ["reason"],
        registry=REGISTRY,
    ),
)
GENERATED_TOKENS = Counter(
    "pdserve_engine_generated_tokens_total", "Tokens generated", registry=REGISTRY
)

# every label value at 0 from the start: a fresh dashboard shows each panel
init_labels(KV_STORE_ERRORS, STORE_OPS)
init_labels(KV_STORE_SECONDS, STORE_OPS)
init_labels(KV_LOADED_TOKENS, ("prefill", "decode"))
init_labels(KV_COMPUTED_TOKENS, ("uncached", "local", "kv_miss", "store_error"))
init_labels(KV_CHUNK_MISSES, CHUNK_KINDS)
init_labels(KV_CHUNKS_WRITTEN, CHUNK_KINDS)
init_labels(KV_STORE_BYPASSED, BYPASS_REASONS)
