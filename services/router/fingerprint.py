"""The router's KV fingerprint, agreed with the workers instead of configured twice, and the
check that keeps workers with another fingerprint out of placement.

The router computes chain keys to ask the store how much of a prompt is cached and to route by
it, so its fingerprint must equal the workers' (model revision, served name, KV dtype, chunk
size, chunk encoding, layout, TP). The model part comes from the router's own model folder;
``kv_dtype``, ``chunk_size`` and ``kv_compression`` come from the router's config when set,
else from what the workers registered (their fingerprint's labels,
:meth:`pdserve.hashing.ModelFingerprint.to_labels`, read back with ``from_labels``; workers
that register no ``kv_compression`` store uncompressed chunks). When workers disagree, the
cluster's settings are those most workers registered (ties: the smallest), among those an
explicit router setting allows.

Every worker also registers its fingerprint's digest (label ``fingerprint``). A worker whose
digest differs from the router's fingerprint would miss every lookup and store chunks no one
finds: :meth:`FingerprintSource.refusals` says why, and the worker pool keeps it out of
placement (``services/router/workers.py``). Disagreements are logged once each.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdserve.hashing import DIGEST_LABEL, ModelFingerprint

log = logging.getLogger(__name__)

AUTO_DTYPE = "auto"

#: A worker's KV settings as the keys see them: (kv_dtype, chunk_size, stored encoding,
#: tensor-parallel size: the keys are those of the fingerprint of TP rank 0, KV options: like
#: the TP size, always the workers').
Settings = tuple[str, int, str, int, str]


def _stored_encoding(kv_compression: str, kv_dtype: str) -> str:
    """bf16 of bfloat16 KV is stored (and keyed) as none (EngineConfig.resolved_kv_compression)."""
    return "none" if kv_compression == "bf16" and kv_dtype == "bfloat16" else kv_compression


def _settings(labels: Mapping[str, str]) -> Settings | None:
    """A worker's registered settings, read with the fingerprint codec
    (:meth:`ModelFingerprint.from_labels`); None when it registered none (or ones no
    fingerprint can have: its digest then differs, and it is refused)."""
    dtype = labels.get("kv_dtype", "")
    encoding = _stored_encoding(labels.get("kv_compression", "none"), dtype)
    try:
        fp = ModelFingerprint.from_labels({**labels, "kv_compression": encoding}, model_id="?")
    except ValueError:
        return None
    return fp.kv_dtype, fp.chunk_size, fp.kv_compression, fp.tp_size, fp.options


class FingerprintSource:
    """``current()`` is the fingerprint to key prompts with, or None while it is unknown
    (auto settings and no worker registered yet: nothing can be routed then anyway).
    ``workers()`` gives the labels of every registered worker."""

    def __init__(
        self,
        model_id: str,
        revision: str,
        *,
        kv_dtype: str,
        chunk_size: int,
        workers: Callable[[], Iterable[Mapping[str, str]]],
        kv_compression: str = AUTO_DTYPE,
    ) -> None:
        self._model_id = model_id
        self._revision = revision
        self._kv_dtype = "" if kv_dtype == AUTO_DTYPE else kv_dtype
        self._chunk_size = chunk_size
        self._kv_compression = "" if kv_compression == AUTO_DTYPE else kv_compression
        self._workers = workers
        self._cache: dict[Settings, ModelFingerprint] = {}
        self._warned: set[object] = set()

    @classmethod
    def fixed(cls, fp: ModelFingerprint) -> FingerprintSource:
        return cls(
            fp.model_id,
            fp.revision,
            kv_dtype=fp.kv_dtype,
            chunk_size=fp.chunk_size,
            workers=lambda: (),
            kv_compression=fp.kv_compression,
        )

    def _allowed(self, s: Settings) -> bool:
        """Whether worker settings ``s`` fit the router's explicit settings."""
        dtype, chunk, encoding, _tp, _options = s
        return (
            (not self._kv_dtype or self._kv_dtype == dtype)
            and (not self._chunk_size or self._chunk_size == chunk)
            and (
                not self._kv_compression
                or _stored_encoding(self._kv_compression, dtype) == encoding
            )
        )

    def _warn_once(self, key: object, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def current(self) -> ModelFingerprint | None:
        seen = Counter(s for s in map(_settings, self._workers()) if s is not None)
        ranked = sorted(seen, key=lambda s: (not self._allowed(s), -seen[s], s))
        # the auto settings come from the first: the most registered that the explicit ones
        # allow, else the most registered (explicit settings then differ from every worker's)
        pick = ranked[0] if ranked else None
        dtype = self._kv_dtype or (pick[0] if pick else "")
        chunk = self._chunk_size or (pick[1] if pick else 0)
        if not dtype or not chunk:
            return None
        if self._kv_compression:
            encoding = _stored_encoding(self._kv_compression, dtype)
        else:
            encoding = pick[2] if pick else "none"
        key = (dtype, chunk, encoding, pick[3] if pick else 1, pick[4] if pick else "")
        if len(seen) > 1:
            self._warn_once(
                frozenset(seen),
                "workers disagree on their KV settings (kv_dtype/chunk_size/kv_compression/"
                "tp_size/kv_options: workers) %s: the cluster's are %s; workers with others are "
                "refused",
                {"/".join(map(str, s)): n for s, n in sorted(seen.items())},
                "/".join(map(str, key)),
            )
        if pick is not None and not self._allowed(pick):
            self._warn_once(
                ("router", frozenset(seen)),
                "router kv_dtype=%s chunk_size=%s kv_compression=%s fit no worker's registered "
                "KV settings %s: every worker is refused",
                self._kv_dtype or AUTO_DTYPE,
                self._chunk_size or AUTO_DTYPE,
                self._kv_compression or AUTO_DTYPE,
                sorted(seen),
            )
        fp = self._cache.get(key)
        if fp is None:
            fp = ModelFingerprint(
                model_id=self._model_id,
                revision=self._revision,
                kv_dtype=dtype,
                chunk_size=chunk,
                kv_compression=encoding,
                tp_size=key[3],
                options=key[4],
            )
            self._cache[key] = fp
        return fp

    def refusals(self, workers: Sequence[Mapping[str, str]]) -> list[str]:
        """For each worker's labels, why it must get no work ("" = it may): the fingerprint
        it registered differs from the router's (every store lookup would miss, every chunk
        it stores would be keyed for no one else). Workers that registered no fingerprint
        (static addresses) are never refused."""
        fp = self.current()
        if fp is None:
            return [""] * len(workers)
        expected = fp.to_labels()
        ours = expected.pop(DIGEST_LABEL)
        out = []
        for labels in workers:
            theirs = labels.get(DIGEST_LABEL, "")
            if not theirs or theirs == ours:
                out.append("")
                continue
            diffs = [
                f"{name} {labels.get(name, '?')} != {want}"
                for name, want in expected.items()
                if labels.get(name, "none" if name == "kv_compression" else "?") != want
            ]
            out.append(
                "KV fingerprint differs from the cluster's"
                + (f" ({', '.join(diffs)})" if diffs else " (model id)")
            )
        return out
