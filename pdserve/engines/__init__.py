"""Model engines behind one interface (:mod:`pdserve.engines.base`), one file per
implementation; :func:`create_engine` picks one from the config."""

from __future__ import annotations

from typing import Any

from pdserve.engines.base import Engine
from pdserve.engines.config import EngineConfig


def create_engine(cfg: EngineConfig, store: Any | None = None) -> Engine:
    """The engine named by ``cfg.engine`` (not started). ``store`` is the synchronous
    :class:`pdserve.store.client.StoreClient` the torch engine uses, or None (no store: always
    recompute); the vLLM engine ignores it, because its KV connector runs inside vLLM's own
    processes and opens clients there from ``cfg.store_master``. vLLM is imported only when
    asked for."""
    if cfg.engine == "torch":
        from pdserve.engines.torch_engine import TorchEngine

        return TorchEngine(cfg, store)
    if cfg.engine == "vllm":
        from pdserve.engines.vllm_engine import VllmEngine

        return VllmEngine(cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}: use 'torch' or 'vllm'")
