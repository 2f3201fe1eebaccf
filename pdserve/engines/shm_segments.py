"""The POSIX shared-memory segments a process tree maps, so a worker can remove what its vLLM
engine leaves behind.

vLLM's engine talks to its engine-core process through message queues in ``/dev/shm/psm_*``
segments (``multiprocessing.shared_memory``); their creator removes them only when its queue
object is garbage-collected, which a process stopped at shutdown never reaches: every stopped
worker left two 160 MiB segments. The worker notes the segments its engine's processes map
while they run (:func:`mapped_segments`) and removes those that outlive the engine's shutdown
(:func:`remove`). Segments mapped by other processes (another worker on the host) are never
named, so never removed.

A worker killed before its shutdown ends (a supervisor's SIGKILL of its process group, which
takes Python's resource tracker with it, or the OOM killer) removes nothing: the process that
started it does, with the segments it saw the worker's processes map
(:class:`pdserve.procs.ServiceProcess`), those that no live process maps (:func:`in_use`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_MAPPED = re.compile(r"/dev/shm/(psm_[0-9a-f]+)")


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(children.get(p, ()))
    return found


def mapped_segments(pid: int | None = None) -> set[str]:
    """Names of the ``psm_*`` segments mapped by ``pid`` (default: this process) or any of
    its descendants."""
    return _mapped_by(descendants(pid or os.getpid()))


def in_use() -> set[str]:
    """Names of the ``psm_*`` segments any live process maps (that this one may read the
    maps of)."""
    return _mapped_by(int(p.name) for p in Path("/proc").glob("[0-9]*"))


def _mapped_by(pids: Iterable[int]) -> set[str]:
    names: set[str] = set()
    for p in pids:
        try:
            names.update(_MAPPED.findall(Path(f"/proc/{p}/maps").read_text()))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return names


def remove(names: Iterable[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Removes the named segments that still exist; returns those removed."""
    removed = []
    for name in sorted(names):
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove shared memory segment %s: %s", name, exc)
            continue
        removed.append(name)
    if removed:
        log.info("removed %d shared memory segment(s) the engine left: %s", len(removed), removed)
    return removed
