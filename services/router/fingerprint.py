"""The router's KV fingerprint, agreed with the workers instead of configured twice.

The router computes chain keys to ask the store how much of a prompt is cached and to route by
it, so its fingerprint must equal the workers' (model revision, served name, KV dtype, chunk
size). The model part comes from the router's own model folder; ``kv_dtype`` and
``chunk_size`` come from the router's config when set, else from what the workers registered
(labels ``kv_dtype`` and ``chunk_size``). Workers that disagree with each other or with an
explicit router setting are reported once in the log: every lookup would miss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.hashing import ModelFingerprint

log = logging.getLogger(__name__)

AUTO_DTYPE = "auto"


class FingerprintSource:
    """``current()`` is the fingerprint to key prompts with, or None while it is unknown
    (auto settings and no worker registered yet: nothing can be routed then anyway)."""

    def __init__(
        self,
        model_id: str,
        revision: str,
        *,
        kv_dtype: str,
        chunk_size: int,
        labels: Callable[[str], set[str]],
    ) -> None:
        self._model_id = model_id
        self._revision = revision
        self._kv_dtype = kv_dtype
        self._chunk_size = chunk_size
        self._labels = labels
        self._cache: dict[tuple[str, int], ModelFingerprint] = {}
        self._warned: set[str] = set()

    @classmethod
    def fixed(cls, fp: ModelFingerprint) -> FingerprintSource:
        return cls(
            fp.model_id,
            fp.revision,
            kv_dtype=fp.kv_dtype,
            chunk_size=fp.chunk_size,
            labels=lambda _: set(),
        )

    def _setting(self, name: str, configured: str) -> str | None:
        seen = self._labels(name)
        if configured and configured not in (AUTO_DTYPE, "0"):
            if seen - {configured} and name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "router %s is %s but workers registered %s: their store lookups will miss",
                    name,
                    configured,
                    sorted(seen),
                )
            return configured
        if not seen:
            return None
        if len(seen) > 1 and name not in self._warned:
            self._warned.add(name)
            log.warning("workers disagree on %s (%s): using the smallest", name, sorted(seen))
        return min(seen)

    def current(self) -> ModelFingerprint | None:
        dtype = self._setting("kv_dtype", self._kv_dtype)
        chunk = self._setting("chunk_size", str(self._chunk_size))
        if dtype is None or chunk is None:
            return None
        key = (dtype, int(chunk))
        fp = self._cache.get(key)
        if fp is None:
            fp = ModelFingerprint(
                model_id=self._model_id,
                revision=self._revision,
                kv_dtype=dtype,
                chunk_size=int(chunk),
            )
            self._cache[key] = fp
        return fp
