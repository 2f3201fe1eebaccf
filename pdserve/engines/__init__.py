"""Model engines behind one interface (:mod:`pdserve.engines.base`), one file per
implementation; :func:`create_engine` picks one from the config."""

from __future__ import annotations

from typing import Any

from pdserve.engines.base import Engine
from pdserve.engines.config import EngineConfig


def create_engine(cfg: EngineConfig) -> Engine:
    """The engine named by ``cfg.engine`` (not started), reaching the store at
    ``cfg.store_master`` (of ``cfg.store_backend``) its own way: the torch engine opens one synchronous client in this
    process (closed with the engine); vLLM's KV connector opens its clients inside vLLM's own
    processes. No store address: always recompute. vLLM is imported only when asked for."""
    if cfg.engine == "torch":
        from pdserve.engines.torch_engine.engine import TorchEngine

        store: Any | None = None
        if cfg.store_master:
            from pdserve.store import open_store

            if cfg.store_backend == "mooncake":
                options = cfg.mooncake_options(cfg.store_segment_size)
                store = open_store(cfg.store_master, backend="mooncake", **options)
            else:
                store = open_store(
                    cfg.store_master, transport=cfg.store_transport, timeout_s=cfg.store_timeout_s
                )
        return TorchEngine(cfg, store, owns_store=True)
    if cfg.engine == "vllm":
        from pdserve.engines.vllm_engine import VllmEngine

        return VllmEngine(cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}: use 'torch' or 'vllm'")
