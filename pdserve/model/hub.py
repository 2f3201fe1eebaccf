"""Hugging Face model ids (``organization/name``), resolved as ``vllm serve`` resolves them:
the model's folder in the local Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded
from the hub first when it is not there and the hub is reachable (``HF_HUB_OFFLINE=1``: never)."""

from __future__ import annotations

import re
from pathlib import Path

#: A Hugging Face model id: ``organization/name``.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: The files of a Hugging Face model that serving needs (weights, config, tokenizer).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hub_cached(repo_id: str) -> Path | None:
    """The folder of Hugging Face model ``repo_id`` in the local Hugging Face cache (its
    ``main`` snapshot, as ``vllm serve`` finds it), or None when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return folder if (folder / "config.json").is_file() else None


def hub_download(repo_id: str) -> Path:
    """Downloads Hugging Face model ``repo_id`` into the Hugging Face cache (what serving needs
    of it) and returns its folder."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:  # network, auth, a missing repository: all end here
        raise ValueError(
            f"model {repo_id!r} is not in the Hugging Face cache ({hub_cache_dir()}) and could "
            f"not be downloaded from the hub: {exc}"
        ) from None
