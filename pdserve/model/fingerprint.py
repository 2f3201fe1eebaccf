"""The one way every process (workers and router) derives a model's KV fingerprint.

Workers and the router must compute identical chain keys (see :mod:`pdserve.hashing`), so the
fingerprint is built here and nowhere else.
"""

from __future__ import annotations

import json
from pathlib import Path

import blake3

from pdserve.hashing import ModelFingerprint

#: Files whose bytes define the model's weights and shapes; their names and sizes (weights) or
#: contents (config) go into the revision.
_CONFIG_FILE = "config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def model_revision(model_dir: str | Path) -> str:
    """A short, host-independent revision string for the model folder: a hash of the
    canonicalised ``config.json`` plus the name and size of every weight file."""
    root = Path(model_dir)
    h = blake3.blake3()
    config = root / _CONFIG_FILE
    if config.is_file():
        data = json.loads(config.read_text())
        h.update(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            h.update(f"{path.name}:{path.stat().st_size};".encode())
    return h.hexdigest()[:16]


def model_fingerprint(
    model_dir: str | Path,
    served_name: str,
    kv_dtype: str,
    chunk_size: int,
    kv_compression: str = "none",
    tp_size: int = 1,
) -> ModelFingerprint:
    """The :class:`ModelFingerprint` of ``model_dir`` served as ``served_name``.

    Contract: a pure function of the folder's config and weight files, the served name, the KV
    dtype, the chunk size, the chunk encoding (resolved:
    ``EngineConfig.resolved_kv_compression``) and the tensor-parallel size (the fingerprint is
    rank 0's, whose keys are the chain's: :func:`pdserve.hashing.rank_key`); identical across
    processes, hosts and restarts.
    """
    return ModelFingerprint(
        model_id=served_name,
        revision=model_revision(model_dir),
        kv_dtype=kv_dtype,
        chunk_size=chunk_size,
        kv_compression=kv_compression,
        tp_size=tp_size,
    )
