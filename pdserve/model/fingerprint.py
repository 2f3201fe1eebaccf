"""The one way every process (workers and router) derives a model's KV fingerprint.

Workers and the router must compute identical chain keys (see :mod:`pdserve.hashing`), so the
fingerprint is built here and nowhere else.

What the revision covers (:func:`describe_revision`), and why:

* every weight file's bytes (``.safetensors``, ``.bin``, ``.gguf``, ``.pt``, ``.pth`` in the
  folder itself), by BLAKE3 of their content: a fine-tuned checkpoint of the same shape has
  different KV for the same tokens, so it must not share a single key with the old weights.
  Digests are cached beside the files (:mod:`pdserve.model.file_digest`): a start reads the
  weights only when they changed;
* ``config.json``, canonicalised (parsed, keys sorted): it fixes the architecture, rope
  scaling and everything else that shapes the KV;
* the commit of a Hugging Face snapshot folder (``.../models--org--name/snapshots/<commit>``).

Not covered: tokenizer files and ``generation_config.json``. Keys are computed over token ids,
so a different tokenizer gives different ids (and so different keys) for the same text, never
different KV for the same ids; sampling settings do not touch the KV at all. File names enter
only relative to the folder, never the folder's path: a copy of the same bytes elsewhere (on
another host) keeps its fingerprint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import blake3

from pdserve.hashing import ModelFingerprint
from pdserve.model.file_digest import CACHE_NAME, file_digests
from pdserve.model.hub import HUB_FILES, HUB_ID, hub_cache_dir

_CONFIG_FILE = "config.json"
#: Suffixes of the files whose bytes are the model's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: Hex digits of a revision and of an adapter's content digest (128 bits).
DIGEST_HEX = 32
_SNAPSHOT_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelRevision:
    """What went into a model folder's revision, and the revision itself."""

    #: BLAKE3 hex of the canonicalised ``config.json``; ``""`` when the folder has none.
    config: str
    #: (file name, BLAKE3 hex of its bytes) of every weight file, sorted by name.
    weights: tuple[tuple[str, str], ...]
    #: The Hugging Face snapshot commit of the folder; ``""`` when it is not a snapshot.
    hub_commit: str
    #: The revision: :data:`DIGEST_HEX` hex digits of a BLAKE3 over all of the above.
    revision: str


def hub_snapshot_commit(folder: Path) -> str:
    """The commit of a Hugging Face cache snapshot folder
    (``.../models--org--name/snapshots/<commit>``), else ``""``."""
    parts = folder.absolute().parts
    if (
        len(parts) >= 3
        and parts[-2] == "snapshots"
        and parts[-3].startswith("models--")
        and _SNAPSHOT_COMMIT.fullmatch(parts[-1])
    ):
        return parts[-1]
    return ""


def describe_revision(model_dir: str | Path) -> ModelRevision:
    """The :class:`ModelRevision` of ``model_dir``. Raises ValueError when it is not a folder
    or holds neither a ``config.json`` nor a weight file, OSError when a file cannot be read."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"model folder {str(root)!r} is not a folder")
    h = blake3.blake3(b"pdserve-revision-2")
    config = ""
    if (root / _CONFIG_FILE).is_file():
        data = json.loads((root / _CONFIG_FILE).read_text())
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        config = blake3.blake3(canonical).hexdigest()
    weights = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not config and not weights:
        raise ValueError(f"model folder {str(root)!r} holds no config.json and no weight file")
    digests = file_digests(weights)
    named = tuple((p.name, digests[p]) for p in weights)
    commit = hub_snapshot_commit(root)
    h.update(f"config:{config};".encode())
    for name, digest in named:
        h.update(f"weight:{len(name)}:{name}:{digest};".encode())
    h.update(f"hub:{commit};".encode())
    return ModelRevision(config, named, commit, h.hexdigest()[:DIGEST_HEX])


def model_revision(model_dir: str | Path) -> str:
    """A host-independent revision string for the model folder: :func:`describe_revision`'s."""
    return describe_revision(model_dir).revision


def adapter_identity(name: str, path: str) -> str:
    """``"<name>:<content digest>"`` of an adapter (a LoRA) at ``path``, for
    :func:`pdserve.hashing.chain_root`: the digest is :data:`DIGEST_HEX` hex digits of a BLAKE3
    over every file's relative name and bytes (a folder: all files below it, recursively,
    skipping names that start with a dot; a file: its bytes and name), hashed once and cached
    like a model's weights. Two adapters share keys only with the same name and the same bytes.
    Raises ValueError for an empty name or a path that is neither a file nor a folder."""
    if not name:
        raise ValueError("adapter name must not be empty")
    root = Path(path)
    if root.is_file():
        files = {root.name: root}
    elif root.is_dir():
        files = {
            p.relative_to(root).as_posix(): p
            for p in sorted(root.rglob("*"))
            if p.is_file()
            and p.name != CACHE_NAME
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        }
    else:
        raise ValueError(f"adapter {name!r}: {path!r} is neither a file nor a folder")
    digests = file_digests(list(files.values()))
    h = blake3.blake3(b"pdserve-adapter-1")
    for rel in sorted(files):
        h.update(f"{len(rel)}:{rel}:{digests[files[rel]]};".encode())
    return f"{name}:{h.hexdigest()[:DIGEST_HEX]}"


def model_source(model: str, revision: str | None = None) -> Path:
    """The folder whose bytes are ``model``, as vLLM names it (``model_config.model`` and
    ``model_config.revision``): a local folder as it is; a Hugging Face id (``org/name``) as
    its snapshot in the local Hugging Face cache (``revision``: a branch, tag or commit; None:
    ``main``), looked up offline. Raises ValueError when it is neither: the fingerprint covers
    the weights' bytes, so they must be on disk (vLLM has downloaded them by the time its KV
    connector starts; elsewhere, ``huggingface-cli download`` them first)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder
    if HUB_ID.fullmatch(model):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(
                snapshot_download(
                    model, revision=revision, allow_patterns=HUB_FILES, local_files_only=True
                )
            )
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass
    at = f" at revision {revision!r}" if revision else ""
    raise ValueError(
        f"model {model!r}{at} is neither a folder nor in the local Hugging Face cache "
        f"({hub_cache_dir()}): its KV fingerprint covers the weights' bytes, so they must be "
        "on disk"
    )


def model_fingerprint(
    model_dir: str | Path,
    served_name: str,
    kv_dtype: str,
    chunk_size: int,
    kv_compression: str = "none",
    tp_size: int = 1,
    options: str = "",
) -> ModelFingerprint:
    """The :class:`ModelFingerprint` of ``model_dir`` served as ``served_name``.

    Contract: a pure function of the folder's config and weight bytes (:func:`model_revision`),
    the served name, the KV dtype, the chunk size, the chunk encoding (resolved:
    ``EngineConfig.resolved_kv_compression``), the tensor-parallel size (the fingerprint is
    rank 0's, whose keys are the chain's: :func:`pdserve.hashing.rank_key`) and the runtime
    options that change the KV (:func:`pdserve.model.kv_options.kv_options`); identical
    across processes, hosts and restarts.
    """
    return ModelFingerprint(
        model_id=served_name,
        revision=model_revision(model_dir),
        kv_dtype=kv_dtype,
        chunk_size=chunk_size,
        kv_compression=kv_compression,
        tp_size=tp_size,
        options=options,
    )
