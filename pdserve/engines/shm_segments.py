"""The POSIX shared-memory segments a process tree maps, so a worker can remove what its vLLM
engine leaves behind.

vLLM's engine talks to its engine-core process through message queues in ``/dev/shm/psm_*``
segments (``multiprocessing.shared_memory``); their creator removes them only when its queue
object is garbage-collected, which a process stopped at shutdown never reaches: every stopped
worker left two 160 MiB segments (and, with tensor parallelism on CPU, its ranks'
``vllm_dist_*cpushm_*`` buffers). The worker notes the segments its engine's processes map
while they run (:func:`mapped_segments`) and removes those that outlive the engine's shutdown
(:func:`remove`). Segments mapped by other processes (another worker on the host) are never
named, so never removed.

A worker killed before its shutdown ends (a supervisor's SIGKILL of its process group, which
takes Python's resource tracker with it, or the OOM killer) removes nothing: the process that
started it does, with the segments it saw the worker's processes map
(:class:`pdserve.procs.ServiceProcess`, :func:`mapped_files`: its tree and its process group,
whose helpers may outlive the service process), those that no live process maps
(:func:`in_use`) once the group's processes have exited. The same goes for the named
semaphores of Python's ``multiprocessing`` (``/dev/shm/sem.mp-*``, 32 bytes each, left the
same way by a killed spawn-context process; only the supervisor removes them, a live
worker's own finalizers unlink its own): glibc's
``sem_open`` maps a file it made under a temporary name before linking it to the semaphore's,
so a maps line may name that temporary file "(deleted)"; they are found by inode instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
#: vLLM's message queues (``psm_*``) and, with tensor parallelism on CPU, its ranks' shared
#: buffers (``vllm_dist_<id>-tp:<rank>-[<ranks>]-cpushm_<n>``, 4 MiB each, also left behind).
_MAPPED = re.compile(r"/dev/shm/(psm_[0-9a-f]+|vllm_dist_[0-9a-f]+-\S*cpushm_\d+)")
#: The inode of a maps line of a file under /dev/shm/sem.* (a POSIX named semaphore).
_SEMAPHORE = re.compile(r"^\S+ \S+ \S+ \S+ (\d+) +/dev/shm/sem\.", re.MULTILINE)
#: The prefix of the semaphores Python's multiprocessing names (the only ones removed).
_MP_SEMAPHORE = "sem.mp-"


#: ``(pid, parent pid, process group)`` of live processes, as :func:`_processes` reads them.
_Procs = list[tuple[int, int, int]]


def _processes() -> _Procs:
    """``(pid, parent pid, process group)`` of every live process (zombies left out: they
    map nothing and are gone once reaped)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] not in ("Z", "X"):
            out.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return out


def descendants(pid: int, processes: _Procs | None = None) -> set[int]:
    """``pid`` and every live process below it (from ``processes``, default ``/proc`` now)."""
    children: dict[int, list[int]] = {}
    for p, parent, _group in _processes() if processes is None else processes:
        children.setdefault(parent, []).append(p)
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(children.get(p, ()))
    return found


def group(pgid: int, processes: _Procs | None = None) -> set[int]:
    """The live processes of process group ``pgid`` (from ``processes``, default ``/proc``
    now): a service's helpers whose parent exited first (an engine core orphaned by its
    server) are no one's descendants, but still in the group the service was started in."""
    procs = _processes() if processes is None else processes
    return {p for p, _parent, g in procs if g == pgid}


def mapped_segments(pid: int | None = None) -> set[str]:
    """Names of the ``psm_*`` segments mapped by ``pid`` (default: this process) or any of
    its descendants: what an engine removes after its own shutdown. Not its semaphores: the
    live process still holds those, and its own finalizers unlink them."""
    return _mapped_by(descendants(pid or os.getpid()), semaphores=False)


def mapped_files(pid: int, *, tree: bool = True) -> set[str]:
    """Names of the ``psm_*`` segments and ``sem.mp-*`` semaphores mapped by any process of
    the group ``pid`` leads and, with ``tree`` (while ``pid`` runs: the number of a reaped
    process may be reused), by ``pid`` and its descendants: what a supervisor removes once
    the process group is gone, if no live process maps them (:func:`in_use`)."""
    procs = _processes()  # one reading of /proc for both
    return _mapped_by(group(pid, procs) | (descendants(pid, procs) if tree else set()))


def in_use() -> set[str]:
    """Names of the ``psm_*`` segments and ``sem.mp-*`` semaphores any live process maps
    (that this one may read the maps of)."""
    return _mapped_by(int(p.name) for p in Path("/proc").glob("[0-9]*"))


def _mapped_by(pids: Iterable[int], semaphores: bool = True) -> set[str]:
    names: set[str] = set()
    inodes: set[int] = set()
    for p in pids:
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        names.update(_MAPPED.findall(maps))
        if semaphores:
            inodes.update(int(i) for i in _SEMAPHORE.findall(maps))
    if inodes:
        try:
            with os.scandir(SHM_DIR) as entries:
                names.update(
                    e.name
                    for e in entries
                    if e.name.startswith(_MP_SEMAPHORE) and e.inode() in inodes
                )
        except OSError:
            pass
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
