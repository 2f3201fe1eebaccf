"""The vLLM engine: vLLM's ``AsyncLLM`` with the pdserve KV connector
(:mod:`pdserve.engines.vllm_connector`) moving prompt KV through the store.

- ``prefill``: ``max_tokens=1``; the connector loads the cached prefix chunks, saves every
  newly completed prompt chunk and the partial tail (under :func:`pdserve.hashing.tail_key`),
  synchronously at the end of the step that computed them, so when vLLM returns the first
  token every chunk is committed in the store.
- ``generate`` with a :class:`KVRef`: the prompt becomes ``prompt + [first_token]``; the
  connector loads the full chunks and the tail (the whole original prompt) and vLLM computes
  only the first token's position. Without a handle, vLLM prefills locally and the connector
  still reuses stored prefix chunks (and saves new ones; with a save queue, a GPU's default,
  written off the step by a background thread, since no one awaits them:
  :mod:`pdserve.engines.save_writer`).
- ``generate`` with a write-mode handle (no first token, ``chunk_wait_ms`` > 0: the router's
  write plan, prefill running at the same time elsewhere): the same contract as the torch
  engine's. The handle names the prompt's first ``(n - 1) // chunk_size`` full chunks; the
  connector waits for them with vLLM's asynchronous KV load (the request is parked in
  ``WAITING_FOR_REMOTE_KVS`` and each chunk is scattered as it lands, on a connector thread,
  while vLLM keeps stepping the other requests), then vLLM computes the rest of the prompt and
  samples the first token. Chunks that do not land within ``chunk_wait_ms`` each are
  recomputed. A handle that does not match the prompt is ignored (a local prefill).
- A failed load (miss, corrupt chunk, store down) is recomputed by vLLM
  (``kv_load_failure_policy="recompute"``): slower, never a different token.

vLLM's own features stay on: continuous batching, chunked prefill, local prefix caching. A
request's cache salt goes to vLLM with the prompt (its local prefix cache is per salt) and
selects the chunk keys the connector loads and saves (per salt in the store too).
Its scheduler is :class:`pdserve.engines.vllm_scheduler.StreamFirstScheduler`, which on a CPU
sizes a step's prompt tokens to keep decoding streams within ``tpot_target_ms``; on a GPU vLLM's
own defaults hold (:mod:`pdserve.engines.vllm_profile`). The model runs in
``dtype = kv_dtype`` (auto: bfloat16; float32 keeps greedy output token-exact against the torch
engine and lets both engines share chunks).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from pdserve import hashing, identity, telemetry, tenants, tracing
from pdserve.engines import kv_layout, metrics, shm_segments, vllm_args
from pdserve.engines.base import (
    Engine,
    EngineLoad,
    PrefillOutcome,
    TokenEvent,
    next_text,
    text_stream,
)
from pdserve.engines.config import EngineConfig
from pdserve.engines.connector_data import PARAMS_KEY, extra_config
from pdserve.engines.vllm_profile import engine_kwargs, load_async, on_gpu, save_queue_mib
from pdserve.errors import InvalidArgument
from pdserve.model.fingerprint import model_fingerprint
from pdserve.model.kv_options import kv_options, refuse_pipeline_parallel
from pdserve.requests import Finish, KVRef, Sampling, TokenLogprob

CONNECTOR_MODULE = "pdserve.engines.vllm_connector"
CONNECTOR_CLASS = "PdserveConnector"

log = logging.getLogger(__name__)


def prepare_environment(config: EngineConfig, cache_root: str | None = None) -> None:
    """Environment vLLM reads at engine start: KV cache size and core binding on CPU, and
    caches kept out of the user's home. Call before building the engine."""
    os.environ.setdefault(
        "VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(config.vllm_kv_cache_gib)))
    )
    if config.vllm_cpu_cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.vllm_cpu_cores
    root = Path(cache_root or os.environ.get("PDSERVE_CACHE_DIR", "/tmp/pdserve-vllm"))
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        if var not in os.environ:
            os.environ[var] = str(root / sub)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def sampling_params(
    sampling: Sampling,
    *,
    max_tokens: int,
    extra: dict[str, Any] | None,
    prior_output: int | None = None,
) -> Any:
    """Maps pdserve :class:`Sampling` to vLLM ``SamplingParams`` (stop strings are handled by
    :class:`TextStream` so both engines stop identically).

    ``prior_output``: a token already generated that vLLM sees as the prompt's last (prefill's
    first token, appended to the prompt for the KV handle's load). Its presence and frequency
    penalties, which vLLM applies to generated tokens only, are folded into ``logit_bias``, so
    the tokens after it are penalized as in one engine's generation (both are constant
    per-token subtractions; with a repetition penalty too, vLLM applies that one after the bias,
    so the first token's share is then scaled with it: a small difference, see docs/router.md).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    bias = dict(sampling.logit_bias)
    fold = sampling.presence_penalty + sampling.frequency_penalty
    if prior_output is not None and fold:
        bias[prior_output] = bias.get(prior_output, 0.0) - fold
    structured = None
    if sampling.json_object:
        structured = StructuredOutputsParams(json_object=True)
    elif sampling.json_schema:
        structured = StructuredOutputsParams(json=sampling.json_schema)
    # min_tokens counts vLLM's own outputs: prefill's first token (prior_output) is one already
    already = 1 if prior_output is not None else 0
    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=min(max_tokens, max(0, sampling.min_tokens - already)),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        seed=sampling.seed,
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=bias or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        logprobs=sampling.logprobs,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args={"kv_transfer_params": extra} if extra else None,
    )


def token_logprobs(out: Any, ids: Sequence[int], top: int | None) -> list[TokenLogprob]:
    """The logprobs vLLM returned with ``out``'s new tokens ``ids`` (its ``logprobs``: per
    token a dict token id -> ``Logprob`` holding the sampled token and the ``top`` best by rank).
    """
    if top is None:
        return []
    entries = out.outputs[0].logprobs or []
    result = []
    for token, d in zip(ids, entries[-len(ids) :] if ids else [], strict=False):
        ranked = sorted(
            ((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= top),
            key=lambda item: item[1].rank,
        )
        best = tuple((int(t), float(lp.logprob)) for t, lp in ranked[:top])
        result.append(TokenLogprob(int(token), float(d[token].logprob), best))
    return result


class VllmEngine(Engine):
    """One vLLM ``AsyncLLM`` with the pdserve KV connector (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self._llm: Any = None
        self._tokenizer: Any = None
        self._running = 0
        self._waiting = 0
        #: vLLM's KV cache usage (blocks in use / blocks) as of its latest scheduler step.
        self._kv_usage = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from pdserve.model.prepare import resolve_model

        cfg = self.config
        model_dir = await asyncio.to_thread(resolve_model, cfg.model)
        served = cfg.served_model_name or cfg.model
        if cfg.store_master:
            pp = cfg.vllm_args.get("pipeline_parallel_size", 1)
            refuse_pipeline_parallel(pp, "vllm_args.pipeline_parallel_size")
        self.fingerprint = model_fingerprint(
            model_dir,
            served,
            cfg.resolved_kv_dtype(),
            cfg.chunk_size,
            cfg.resolved_kv_compression(),
            tp_size=int(cfg.vllm_args.get("tensor_parallel_size", 1)),
            options=kv_options(cfg.vllm_args, model_dir),
        )
        prepare_environment(cfg)
        self._llm = await asyncio.to_thread(self._build, model_dir, served)
        if cfg.store_master:  # the same check as the connector's scheduler side
            reason = kv_layout.config_layout_error(self._llm.vllm_config)
            if reason:
                self.store_off = f"vLLM's KV cache layout cannot be converted: {reason}"
                log.error("serving WITHOUT the KV store: %s", self.store_off)
            metrics.KV_STORE_OFF.set(1 if reason else 0)
        self._tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        eos = self._tokenizer.eos_token_id
        self.eos_token_id = int(eos if eos is not None else -1)

    def _build(self, model_dir: Path, served: str) -> Any:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        kv_transfer = None
        gpu = on_gpu()  # the device picks the connector's and the engine's defaults
        if cfg.store_master:
            kv_transfer = KVTransferConfig(
                kv_connector=CONNECTOR_CLASS,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra_config(
                    cfg.store_master,
                    self.fingerprint,
                    tail_ttl_ms=cfg.tail_ttl_ms,
                    transport=cfg.store_transport,
                    replicas=cfg.store_replicas,
                    timeout_s=cfg.store_timeout_s,
                    save_queue_mib=save_queue_mib(cfg.store_save_queue_mib, gpu),
                    load_async=load_async(cfg.store_load_async, gpu),
                    backend=cfg.store_backend,
                    backend_options=(
                        cfg.mooncake_options(cfg.store_segment_size)
                        if cfg.store_backend == "mooncake"
                        else None
                    ),
                    tls=identity.tls(),
                ),
            )
        # pdserve's serving profile on a CPU, vLLM's own defaults on a GPU (vllm_profile)
        profile = engine_kwargs(cfg, gpu)
        if tracing.enabled():  # vLLM's llm_request span, and trace headers to the connector
            profile["otlp_traces_endpoint"] = tracing.endpoint()
        args = AsyncEngineArgs(
            model=str(model_dir),
            served_model_name=[served],
            dtype=cfg.resolved_kv_dtype(),
            block_size=cfg.vllm_block_size,
            max_model_len=cfg.max_model_len or None,  # None: the model's own
            **profile,
            kv_transfer_config=kv_transfer,
            disable_log_stats=True,
            **vllm_args.check(cfg.vllm_args, store=kv_transfer is not None),
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[kv_usage_logger(self)])

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # vLLM's message-queue segments outlive a shutdown (shm_segments' docstring)
            segments = await asyncio.to_thread(shm_segments.mapped_segments)
            await asyncio.to_thread(llm.shutdown)
            shm_segments.remove(segments)

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_text(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    # ------------------------------------------------------------------ requests

    async def _run(
        self, request_id: str, prompt: list[int], params: Any, cache_salt: str, priority: int
    ) -> AsyncIterator[tuple[list[int], Any]]:
        """Yields ``(new token ids, RequestOutput)``; aborts the request when closed early.
        A ``cache_salt`` goes to vLLM with the prompt: it salts vLLM's own block hashes (its
        local prefix cache) and the connector reads it from the request for the chunk keys.
        ``priority`` goes to vLLM's request, whose scheduler orders waiting prompts by it."""
        self._waiting += 1
        started = False
        finished = False
        inputs: dict[str, Any] = {"prompt_token_ids": prompt}
        if cache_salt:
            inputs["cache_salt"] = cache_salt
        tenant = tenants.current.get()
        if tenant and self.config.store_master:  # the connector tags the saved chunks with it
            args = params.extra_args = params.extra_args or {}
            args.setdefault("kv_transfer_params", {}).setdefault(PARAMS_KEY, {})["tenant"] = tenant
        try:
            trace = tracing.headers() or None  # the worker's span: vLLM's joins it
            stream = self._llm.generate(
                inputs, params, request_id, trace_headers=trace, priority=priority
            )
            async for out in stream:
                if not started:
                    started = True
                    self._waiting -= 1
                    self._running += 1
                finished = out.finished
                yield list(out.outputs[0].token_ids), out
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1
            if not finished and self._llm is not None:
                await self._llm.abort(request_id)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        publish_incrementally: bool = False,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,
    ) -> PrefillOutcome:
        prompt = list(prompt_token_ids)
        sampling.validate(self.config.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(prompt, sampling)
        fp = self.fingerprint
        keys = hashing.chunk_keys(fp, prompt, cache_salt)
        store = bool(self.config.store_master)
        tail = hashing.tail_key(fp, prompt, request_id, cache_salt) if store else ""
        extra = {PARAMS_KEY: {"save_tail_key": tail}} if tail else None
        if bypass_store and store:
            tail, extra = "", _bypass_params()
        params = sampling_params(sampling, max_tokens=1, extra=extra)
        first: int | None = None
        first_lp: TokenLogprob | None = None
        result: Any = None
        async for ids, out in self._run(_vllm_id(request_id), prompt, params, cache_salt, priority):
            if ids and first is None:
                first = ids[0]
                lps = token_logprobs(out, ids[:1], sampling.logprobs)
                first_lp = lps[0] if lps else None
            result = out
        if first is None:
            raise RuntimeError(f"vLLM returned no token for request {request_id}")
        loaded = _loaded_tokens(result)
        cached = max(loaded, int(result.num_cached_tokens or 0))
        computed = len(prompt) - cached
        metrics.KV_LOADED_TOKENS.labels("prefill").inc(loaded)
        metrics.KV_COMPUTED_TOKENS.labels("uncached").inc(computed)
        _count_failures(result)
        return PrefillOutcome(
            first_token_id=first,
            kv=KVRef(tuple(keys), tail, len(prompt), fp.chunk_size, fp.digest()),
            cached_tokens=cached,
            computed_tokens=computed,
            first_token_is_eos=first == self.eos_token_id,
            first_logprob=first_lp,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        *,
        kv: KVRef | None = None,
        first_token_id: int | None = None,
        chunk_wait_ms: int = 0,
        cache_salt: str = "",
        bypass_store: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[TokenEvent]:
        prompt = list(prompt_token_ids)
        sampling.validate(self.config.resolved_max_tokens_limit(self.max_model_len))
        self.check_prompt(prompt, sampling)
        t0 = time.perf_counter()
        text = text_stream(self.decode_text, sampling)
        extra: dict[str, Any] | None = None
        max_tokens = sampling.max_tokens
        if kv is not None and first_token_id is None:
            extra = self._write_mode_params(request_id, prompt, kv, chunk_wait_ms, cache_salt)
        elif kv is not None:
            if kv.num_tokens != len(prompt):
                raise InvalidArgument(
                    f"KV handle covers {kv.num_tokens} tokens but the prompt has {len(prompt)}"
                )
            piece, stop = next_text(text, first_token_id, 1, sampling, self.eos_token_id)
            yield TokenEvent(
                [first_token_id], piece, [(time.perf_counter() - t0) * 1e3], finish=stop
            )
            metrics.GENERATED_TOKENS.inc()
            if stop is not None:
                return
            if kv.tail_key:
                extra = {
                    PARAMS_KEY: {"load_tail_key": kv.tail_key, "load_tail_tokens": len(prompt)}
                }
            prompt = [*prompt, first_token_id]
            max_tokens -= 1
        if bypass_store and self.config.store_master:
            extra = _bypass_params()  # no handle load, no wait, no save: all computed here
        prior = first_token_id if kv is not None and first_token_id is not None else None
        params = sampling_params(sampling, max_tokens=max_tokens, extra=extra, prior_output=prior)
        last: Any = None
        async for ids, out in self._run(_vllm_id(request_id), prompt, params, cache_salt, priority):
            last = out
            now = (time.perf_counter() - t0) * 1e3
            # a stop token id (vLLM: stop_reason is the id) ends the output without text, and
            # so does EOS (finish stop, no stop reason), also with skip_special_tokens false
            stop_id = out.finished and isinstance(out.outputs[0].stop_reason, int)
            eos = out.finished and out.outputs[0].finish_reason == "stop" and not stop_id
            pieces = "".join(text.add(t) for t in (ids[:-1] if stop_id or eos else ids))
            finish = None
            if text.stopped:
                finish = Finish.STOP
            elif out.finished:
                pieces += text.flush()
                reason = out.outputs[0].finish_reason
                if reason == "length":
                    finish = Finish.LENGTH
                else:
                    finish = Finish.STOP if stop_id else Finish.EOS
            metrics.GENERATED_TOKENS.inc(len(ids))
            event = TokenEvent(ids, pieces, [now] * len(ids), finish=finish)
            event.logprobs = token_logprobs(out, ids, sampling.logprobs)
            if finish is not None:
                # vLLM's num_cached_tokens counts the local hits plus every planned external
                # token, failed loads included; the prompt is the caller's (without prefill's
                # first token, whose position is generation, not prompt)
                loaded, failed = _loaded_tokens(out), _failed_tokens(out)
                local = max(0, int(out.num_cached_tokens or 0) - loaded - failed)
                event.loaded_tokens = loaded
                event.prefix_cached_tokens = local
                event.recomputed_tokens = max(0, len(prompt_token_ids) - loaded - local)
                self._count_generate(out, kv is not None)
            yield event
            if finish is not None:
                return
        if last is None:
            raise RuntimeError(f"vLLM returned nothing for request {request_id}")

    def _write_mode_params(
        self, request_id: str, prompt: list[int], kv: KVRef, wait_ms: int, cache_salt: str
    ) -> dict[str, Any] | None:
        """The connector's parameters for a write-mode handle: wait for its chunks. None (no
        wait: the connector loads what is stored) without a store or a wait, and for a handle
        that does not name a chunk-aligned prefix of this prompt's keys (ignored, as the torch
        engine does, rather than trusted)."""
        fp = self.fingerprint
        cs = fp.chunk_size
        k = len(kv.chunk_keys)
        if (
            kv.fingerprint != fp.digest()
            or kv.chunk_size != cs
            or kv.tail_key
            or kv.num_tokens != k * cs
            or k * cs > len(prompt)
            or list(kv.chunk_keys) != hashing.chunk_keys(fp, prompt, cache_salt)[:k]
        ):
            log.warning(
                "request %s: KV handle does not match prompt/model; recomputing", request_id
            )
            metrics.KV_CHUNK_MISSES.labels("handle").inc()
            return None
        if not (k and wait_ms > 0 and self.config.store_master):
            return None
        return {PARAMS_KEY: {"await_chunks": k, "chunk_wait_ms": wait_ms}}

    def _count_generate(self, out: Any, with_handle: bool) -> None:
        loaded = _loaded_tokens(out)
        metrics.KV_LOADED_TOKENS.labels("decode").inc(loaded)
        failed = _count_failures(out)
        if not with_handle:
            metrics.KV_COMPUTED_TOKENS.labels("local").inc(
                max(0, len(out.prompt_token_ids or []) - int(out.num_cached_tokens or 0))
            )
        elif failed:
            metrics.KV_COMPUTED_TOKENS.labels("kv_miss").inc(failed)

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_length=self._waiting,
            running_requests=self._running,
            kv_usage=min(1.0, max(0.0, self._kv_usage)),
        )


def kv_usage_logger(engine: VllmEngine) -> Any:
    """A vLLM stat logger (class) that keeps ``engine._kv_usage`` at the KV cache usage of
    vLLM's scheduler stats (``SchedulerStats.kv_cache_usage``: the fraction of KV cache blocks
    in use, cached blocks no request holds counting as free), which the engine core sends with
    every step's outputs, and applies the store metric updates the KV connector made in the
    engine core (``SchedulerStats.kv_connector_stats``, :func:`pdserve.telemetry.replay`) to
    this process's metrics. vLLM calls ``record`` on its output handler task, in the engine's
    event loop. Passing a logger turns vLLM's stats on without its default loggers (vLLM
    still adds its Prometheus logger, on prometheus_client's default registry, whose
    ``vllm:*`` families pdserve's /metrics serves beside its own: telemetry.py)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KVUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                engine._kv_usage = float(scheduler_stats.kv_cache_usage)
                relayed = scheduler_stats.kv_connector_stats
                if relayed:
                    telemetry.replay(relayed.get("updates", []))

        def log_engine_initialized(self) -> None:
            pass

    return KVUsageLogger


def _vllm_id(request_id: str) -> str:
    # vLLM needs unique ids per engine; a retried pdserve request must not collide.
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def _bypass_params() -> dict[str, Any]:
    """The connector's parameters of a request that neither loads nor saves (bypass_store in
    engine.proto; the connector honours them, connector_scheduler.py)."""
    return {PARAMS_KEY: {"bypass_store": True}}


def _pdserve_params(out: Any) -> dict[str, Any]:
    params = getattr(out, "kv_transfer_params", None) or {}
    inner = params.get(PARAMS_KEY, {}) if isinstance(params, dict) else {}
    return inner if isinstance(inner, dict) else {}


def _loaded_tokens(out: Any) -> int:
    return int(_pdserve_params(out).get("loaded_tokens", 0))


def _failed_tokens(out: Any) -> int:
    return int(_pdserve_params(out).get("failed_tokens", 0))


def _count_failures(out: Any) -> int:
    failed = _failed_tokens(out)
    if failed:
        metrics.KV_CHUNK_MISSES.labels("chunk").inc()
    return failed
