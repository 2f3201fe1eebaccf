"""BLAKE3 digests of files' bytes, each file read once and remembered beside it.

A model's weights run to gigabytes, and every worker start derives its fingerprint from them
(:mod:`pdserve.model.fingerprint`), so a digest is cached: a JSON file ``.pdserve-fingerprint.json``
in the file's folder when that folder is writable, else ``fingerprints.json`` under pdserve's cache
folder (``$PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``). An entry is keyed by the file's
absolute path and holds its size, ``mtime_ns``, ``ctime_ns`` and inode: any of them changed and
the file is read again. ``ctime`` is in the key because no user call can set it back: a byte
rewritten in place with the modification time restored (``os.utime``) still changes it. The
cache only ever saves reads; a missing, unreadable or corrupt cache file is rebuilt, never an
error, and two processes writing it at once each leave a whole file (written aside, then
renamed).

Large files are read in 8 MiB blocks and show a progress bar on stderr when it is a terminal.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import blake3

#: The cache file's name inside a writable folder.
CACHE_NAME = ".pdserve-fingerprint.json"
#: The cache file's name under pdserve's cache folder, for read-only model folders.
SHARED_CACHE_NAME = "fingerprints.json"
#: Bytes read per step.
READ_BLOCK = 8 << 20
#: Files at least this large get a progress bar (when stderr is a terminal).
PROGRESS_MIN_BYTES = 256 << 20
_FORMAT = 1


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def hash_file(path: Path, size: int) -> str:
    """The BLAKE3 hex digest of ``path``'s bytes (``size`` of them, for the progress bar),
    read in :data:`READ_BLOCK` steps. Reads the file every time: :func:`file_digest` caches."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    bar = None
    if size >= PROGRESS_MIN_BYTES and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {path.name}")
    try:
        with path.open("rb", buffering=0) as f:
            buf = bytearray(READ_BLOCK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
                if bar is not None:
                    bar.update(n)
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


def cache_path(folder: Path) -> Path:
    """Where the digests of the files in ``folder`` are remembered: beside them when
    ``folder`` is writable, else pdserve's shared cache file."""
    if os.access(folder, os.W_OK):
        return folder / CACHE_NAME
    from pdserve.model.prepare import default_cache_dir

    return default_cache_dir() / SHARED_CACHE_NAME


def _load(cache: Path) -> dict[str, Any]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _store(cache: Path, files: dict[str, Any]) -> None:
    """Writes ``files`` merged over what the cache holds now (another process may have added
    entries since it was read); a cache that cannot be written is skipped."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_load(cache), **files}
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=cache.name, suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from other users of the model
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _FORMAT, "files": merged}, f, indent=1, sort_keys=True)
        os.replace(tmp, cache)
    except OSError:
        return


def file_digests(paths: list[Path]) -> dict[Path, str]:
    """BLAKE3 hex digests of the bytes of ``paths`` (regular files, symlinks followed), each
    read only when its cache entry is missing or its size, mtime, ctime or inode changed.
    Raises OSError when a file cannot be read."""
    out: dict[Path, str] = {}
    by_cache: dict[Path, list[Path]] = {}
    for path in paths:
        by_cache.setdefault(cache_path(path.parent), []).append(path)
    for cache, group in by_cache.items():
        known = _load(cache)
        fresh: dict[str, Any] = {}
        for path in group:
            name = str(path.resolve())
            st = path.stat()
            stat = _stat_key(st)
            entry = known.get(name)
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("blake3"), str)
                and all(entry.get(k) == v for k, v in stat.items())
            ):
                out[path] = entry["blake3"]
                continue
            out[path] = hash_file(path, st.st_size)
            fresh[name] = {**stat, "blake3": out[path]}
        if fresh:
            _store(cache, fresh)
    return out


def file_digest(path: Path) -> str:
    """:func:`file_digests` of one file."""
    return file_digests([path])[path]
