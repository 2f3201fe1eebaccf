"""Configuration shared by every engine (and so by the prefill and decode services)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve import devices
from pdserve.config import ConfigError, help_field
from pdserve.config_fields import auto_on_off
from pdserve.engines.step_budget import PREFILL_ORDERS
from pdserve.hashing import KV_COMPRESSIONS, KV_DTYPES
from pdserve.store import StoreBackendConfig

ENGINES = ("torch", "vllm")
#: Auto ``max_num_batched_tokens`` of the vLLM engine (vLLM's own CPU serving default).
VLLM_STEP_TOKENS = 2048


@dataclass
class EngineConfig(StoreBackendConfig):
    engine: str = help_field(
        "torch", "model backend: 'torch' (transformers reference engine) or 'vllm'"
    )
    model: str = help_field(
        "smollm2",
        "model to serve: a prepared name ('smollm2', 'tiny') or a local model directory",
        metavar="NAME|DIR",
    )
    served_model_name: str = help_field(
        "", "name requests use for this model (empty = --model as given)"
    )
    chunk_size: int = help_field(256, "KV chunk size in tokens (must match across the cluster)")
    kv_dtype: str = help_field(
        "auto",
        f"dtype of the model and its stored KV chunks: auto, {', '.join(KV_DTYPES)} "
        "(auto on vllm = bfloat16 on a GPU or a CPU with native bfloat16 (AVX512-BF16, AMX, "
        "Arm bf16), float32 on other CPUs, where bfloat16 runs about 6x slower; auto on "
        "torch = float32, the token-exact reference). Part of the chunk keys: workers that "
        "should share chunks across machines of different kinds need one explicit value",
    )
    kv_compression: str = help_field(
        "none",
        f"encoding of the KV chunks in the store ({', '.join(KV_COMPRESSIONS)}): none = as "
        "computed; bf16 = bfloat16, half the bytes of float32 KV (a no-op on bfloat16 KV, "
        "such as vllm's default: stored as none); fp8 = float8 e4m3 with a scale per channel, "
        "about half of bfloat16 and a quarter of float32. Chunks are read back in kv_dtype; "
        "part of the chunk keys, so set it alike on every worker of a cluster (`pdserve up "
        "--kv-compression`)",
    )
    max_model_len: int = help_field(
        0,
        "context limit in tokens (prompt + output); 0 = the model's own "
        "(max_position_embeddings), and never above it",
    )
    max_tokens_limit: int = help_field(
        0, "largest max_tokens a request may ask for (0 = the context limit)"
    )
    max_num_seqs: int = help_field(
        0,
        "generations running at once, more wait in the queue (0 = auto: 128 on vllm on a CPU, "
        "as `vllm serve` there, vLLM's own on a GPU; 8 on torch)",
    )
    max_num_batched_tokens: int = help_field(
        0,
        "vllm: tokens one engine step may schedule while no stream is decoding "
        f"(0 = auto: {VLLM_STEP_TOKENS} on a CPU, vLLM's CPU serving default; vLLM's own on a GPU)",
    )
    tpot_target_ms: float = help_field(
        -1.0,
        "vllm: time per output token the scheduler keeps decoding streams within while prompts "
        "prefill beside them: each step takes the most prompt tokens that keeps every stream "
        "on target, from a step-cost model learnt online (0 = vLLM's behaviour: up to "
        "max_num_batched_tokens beside streams; -1 = auto: 150 on a CPU, 0 on a GPU, "
        "pdserve/engines/vllm_profile.py)",
    )
    ttft_urgent_ms: float = help_field(
        1500.0,
        "vllm: a prompt that has waited this long since it arrived prefills in the next step "
        "whatever the streams' target (a late first token cannot be made up; 0 = never)",
    )
    prefill_order: str = help_field(
        "auto",
        "vllm: which waiting prompts prefill together: deadline = those that can all still "
        "get their first token within ttft_target_ms share a step, oldest first (a burst that "
        "fits is batched as vLLM does; of one too large, what can still be on time goes "
        "first), late ones together, oldest first, in a step of at most a quarter of "
        "ttft_target_ms (one waiting twice ttft_target_ms heads the next step), and a stream "
        "whose first token was late no longer limits the steps; shortest / arrival = one "
        "prompt per step, fewest tokens to compute / oldest first; batched = vLLM's own "
        "(every waiting prompt in the next step); auto = deadline on a CPU, batched on a GPU",
    )
    ttft_target_ms: float = help_field(
        2000.0,
        "vllm: the time to first token prefill_order deadline plans for (a prompt's deadline "
        "is its arrival plus this; 0 = every prompt late: one at a time, oldest first, and "
        "every stream kept within tpot_target_ms)",
    )
    store_master: str = help_field(
        "", "KV store master address host:port (empty = no store: always recompute)"
    )
    store_transport: str = help_field(
        "auto", "store data-plane transport: auto|shm|tcp|mooncake (store_backend pdserve)"
    )
    store_segment_size: str = help_field(
        "0",
        "store_backend mooncake: memory this worker contributes to the Mooncake pool "
        "(Mooncake's global_segment_size; 0 = none, objects live in other clients' segments)",
        metavar="SIZE",
    )
    store_timeout_s: float = help_field(5.0, "timeout of one store operation (seconds)")
    store_replicas: int = help_field(
        1, "copies of each stored chunk, on distinct storage nodes (survives node loss when > 1)"
    )
    tail_ttl_ms: int = help_field(
        60000, "time-to-live of a request's partial last chunk in the store (milliseconds)"
    )
    store_save_queue_mib: int = help_field(
        -1,
        "vllm: MiB of KV chunk saves a background thread may write off the engine step (the "
        "step only copies the chunks out; a step that would pass this waits for room; saves a "
        "decode worker loads right after the answer, a P/D prefill's, stay in the step). 0 = "
        "every save in the step: a colocated request's chunks are then in the store by its "
        "answer, with a queue they land just after the step that made them. -1 = auto: 256 on "
        "a GPU, where the step would wait on the store; 0 on a CPU, where the writer would "
        "take the engine's own core (measured: no gain, docs/benchmarks.md)",
    )
    store_load_async: str = help_field(
        "auto",
        "vllm: load stored chunks off the engine step: the request waits in vLLM's "
        "WAITING_FOR_REMOTE_KVS while a connector thread loads its chunks and the other "
        "requests step (on, off, auto = on on a GPU, where a load waits on the network and a "
        "step is the whole batch's TPOT; off on a CPU, where a load is a memory copy on the "
        "engine's own core and a parked request would wait a step more)",
    )
    torch_threads: int = help_field(1, "torch intra-op threads of the model (torch engine)")
    vllm_block_size: int = help_field(
        32, "vLLM KV block size in tokens (CPU: a multiple of 32; chunk_size a multiple of it)"
    )
    vllm_kv_cache_gib: float = help_field(2.0, "vLLM KV cache size (GiB)")
    vllm_cpu_cores: str = help_field(
        "",
        "cores vLLM's CPU worker binds to, e.g. '0' or '0-1'; a worker service also pins its "
        "own process, and so vLLM's engine core, to them (empty = vLLM's default, unpinned)",
    )
    vllm_args: dict = help_field(
        {},
        "more vLLM engine arguments, as `vllm serve` takes them (AsyncEngineArgs fields), e.g. "
        '{"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4}, "enable_chunked_prefill": false}: a YAML mapping, or JSON '
        "on the command line. Fields pdserve sets itself are refused with the field to use",
        metavar="JSON",
    )

    def resolved_kv_dtype(self) -> str:
        """``kv_dtype`` with ``auto`` resolved for this engine."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        if self.engine != "vllm":
            return "float32"
        return devices.vllm_auto_dtype(os.environ)

    def resolved_kv_compression(self) -> str:
        """``kv_compression`` as chunks are stored: ``bf16`` of bfloat16 KV is ``none``."""
        if self.kv_compression == "bf16" and self.resolved_kv_dtype() == "bfloat16":
            return "none"
        return self.kv_compression

    def resolved_max_tokens_limit(self, max_model_len: int) -> int:
        """``max_tokens_limit`` with ``0`` resolved: the engine's context limit."""
        return min(self.max_tokens_limit or max_model_len, max_model_len)

    def resolved_max_num_seqs(self) -> int:
        """``max_num_seqs`` with ``0`` (auto) resolved for this engine."""
        if self.max_num_seqs:
            return self.max_num_seqs
        return 128 if self.engine == "vllm" else 8

    def served_name(self) -> str:
        """The model name requests must use (and the KV fingerprint's model id):
        ``served_model_name``, else ``model`` as given (the router derives it the same way)."""
        return self.served_model_name or self.model

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.model:
            raise ConfigError("model must not be empty")
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be auto or one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ConfigError(
                f"kv_compression must be one of {KV_COMPRESSIONS}, got {self.kv_compression!r}"
            )
        if self.torch_threads <= 0:
            raise ConfigError(f"torch_threads must be positive, got {self.torch_threads}")
        if self.vllm_cpu_cores:
            try:
                devices.parse_cores(self.vllm_cpu_cores)
            except ValueError as exc:
                raise ConfigError(f"vllm_cpu_cores: {exc}") from None
        for name in ("max_model_len", "max_tokens_limit"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = auto), got {getattr(self, name)}")
        for name in ("ttft_urgent_ms", "ttft_target_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.tpot_target_ms < 0 and self.tpot_target_ms != -1:
            raise ConfigError(
                f"tpot_target_ms must be >= 0 (0 = off) or -1 (auto), got {self.tpot_target_ms}"
            )
        if self.prefill_order not in ("auto", *PREFILL_ORDERS):
            raise ConfigError(
                f"prefill_order must be auto or one of {PREFILL_ORDERS}, got {self.prefill_order!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = auto), got {getattr(self, name)}")
        if self.tail_ttl_ms <= 0:
            raise ConfigError(f"tail_ttl_ms must be positive, got {self.tail_ttl_ms}")
        if self.store_replicas < 1:
            raise ConfigError(f"store_replicas must be at least 1, got {self.store_replicas}")
        if self.store_save_queue_mib < -1:
            raise ConfigError(
                f"store_save_queue_mib must be >= 0 (0 = saves in the step) or -1 (auto), got "
                f"{self.store_save_queue_mib}"
            )
        self.store_load_async = auto_on_off(
            "store_load_async", self.store_load_async, "on a GPU, off on a CPU"
        )
        if self.store_timeout_s <= 0:
            raise ConfigError(f"store_timeout_s must be positive, got {self.store_timeout_s}")
        self.check_store_backend()
        if self.store_backend != "mooncake" and self.store_segment_size not in ("", "0"):
            raise ConfigError(
                f"store_segment_size {self.store_segment_size!r} applies to store_backend "
                "mooncake; pdserve's store keeps KV on its storage nodes "
                "(kvstore_node.segment_sizes)"
            )
        if self.engine == "vllm":
            if self.vllm_block_size <= 0 or self.vllm_block_size % 32:
                raise ConfigError(
                    f"vllm_block_size must be a positive multiple of 32, got {self.vllm_block_size}"
                )
            if self.chunk_size % self.vllm_block_size:
                raise ConfigError(
                    f"chunk_size ({self.chunk_size}) must be a multiple of vllm_block_size "
                    f"({self.vllm_block_size})"
                )
            if self.vllm_kv_cache_gib <= 0:
                raise ConfigError(
                    f"vllm_kv_cache_gib must be positive, got {self.vllm_kv_cache_gib}"
                )
