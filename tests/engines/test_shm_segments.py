"""A worker finds the shared-memory segments its engine's processes map, and only those, and
removes what outlives them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from pdserve.engines import shm_segments

CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
m = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(m._name, "shared_memory")  # leak it, as a killed engine does
print(m.name, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_segments_of_a_process_tree_are_found_and_removed_after_it_dies() -> None:
    mine = shared_memory.SharedMemory(create=True, size=4096)  # this process's own: not named
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        found = shm_segments.mapped_segments(child.pid)
        assert found == {name}
        assert mine.name in shm_segments.mapped_segments()  # ours, with our children's
        assert name in shm_segments.mapped_segments()
    finally:
        child.kill()
        child.wait()
    assert (Path("/dev/shm") / name).exists()  # killed: left behind
    assert shm_segments.remove(found) == [name]
    assert not (Path("/dev/shm") / name).exists()
    assert shm_segments.remove(found) == []  # gone already: nothing to do
    mine.close()
    mine.unlink()


TP_CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
m = shared_memory.SharedMemory(create=True, size=4096, name=sys.argv[1])
resource_tracker.unregister(m._name, "shared_memory")  # left behind, as vLLM's TP ranks do
print(m.name, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_vllm_tensor_parallel_buffers_are_found_and_removed() -> None:
    name = f"vllm_dist_{os.urandom(16).hex()}-tp:0-[0-1]-cpushm_0"
    child = subprocess.Popen([sys.executable, "-c", TP_CHILD, name], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip().lstrip("/") == name
        assert shm_segments.mapped_segments(child.pid) == {name}
    finally:
        child.kill()
        child.wait()
    assert shm_segments.remove({name}) == [name]
    assert not (Path("/dev/shm") / name).exists()


SERVICE = """
import multiprocessing, signal, sys, time
from multiprocessing import resource_tracker, shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a shutdown that does not end: SIGKILL follows
own = shared_memory.SharedMemory(create=True, size=4096)
shared = shared_memory.SharedMemory(create=True, size=4096)
for m in (own, shared):
    resource_tracker.unregister(m._name, "shared_memory")  # as a killed engine leaves them
# spawn-context locks: named semaphores in /dev/shm (sem.mp-*) until their owner cleans up
locks = [multiprocessing.get_context("spawn").Lock() for _ in range(2)]
for lock in locks:
    resource_tracker.unregister(lock._semlock.name, "semaphore")
print(own.name, shared.name, *(lock._semlock.name for lock in locks), flush=True)
time.sleep(60)
"""


def _sem_file(name: str) -> Path:
    """The file of the POSIX named semaphore ``name`` ("/mp-..."): /dev/shm/sem.mp-..."""
    return Path("/dev/shm") / f"sem.{name.lstrip('/')}"


@pytest.mark.slow
def test_a_service_killed_in_its_shutdown_leaves_no_segment_but_those_still_mapped(
    tmp_path: Path,
) -> None:
    """ServiceProcess.stop SIGKILLs a service whose shutdown does not end (its group with it,
    Python's resource tracker included) and then removes the segments and multiprocessing
    semaphores the service mapped, except those another live process (this one) still maps."""
    from pdserve.procs import ServiceProcess

    popen = subprocess.Popen(
        [sys.executable, "-c", SERVICE],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc = ServiceProcess("svc", popen, tmp_path / "svc.log")
    own, shared, own_sem, shared_sem = popen.stdout.readline().split()
    ours = shared_memory.SharedMemory(name=shared)  # mapped here too: in use
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    libc.sem_close.argtypes = [ctypes.c_void_p]
    handle = libc.sem_open(shared_sem.encode(), 0)  # opened (so mapped) here too: in use
    assert handle not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        # what an engine removes after its own shutdown: the queues, never the live
        # process's semaphores
        assert shm_segments.mapped_segments(popen.pid) == {own, shared}
        proc.note_segments()
        sems = {_sem_file(own_sem).name, _sem_file(shared_sem).name}
        assert proc.segments == {own, shared} | sems
        assert proc.stop(timeout=0.5) == -9
        assert not (Path("/dev/shm") / own).exists()
        assert (Path("/dev/shm") / shared).exists()
        assert not _sem_file(own_sem).exists()
        assert _sem_file(shared_sem).exists()
        assert proc.segments == set()
    finally:
        popen.kill()
        ours.close()
        ours.unlink()
        libc.sem_close(handle)
        for path in (Path("/dev/shm") / own, _sem_file(own_sem), _sem_file(shared_sem)):
            path.unlink(missing_ok=True)


ORPHANING = """
import os, subprocess, sys
helper = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(helper.stdout.readline().strip(), helper.pid, flush=True)
os._exit(0)  # the service process exits first; its helper runs on, in its group, orphaned
"""


@pytest.mark.slow
def test_segments_of_a_helper_that_outlived_its_service_are_removed(tmp_path: Path) -> None:
    """A service process that exited before its helper (as a vLLM server may leave its engine
    core): the helper is no one's descendant any more, but still in the service's process
    group. ServiceProcess.stop notes what the group maps, SIGKILLs it, waits until the helper
    is gone and removes the segment it left."""
    from pdserve.procs import ServiceProcess

    popen = subprocess.Popen(
        [sys.executable, "-c", ORPHANING, CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc = ServiceProcess("svc", popen, tmp_path / "svc.log")
    name, helper = popen.stdout.readline().split()
    popen.wait()
    segment = Path("/dev/shm") / name
    try:
        assert int(helper) in shm_segments.group(popen.pid)
        assert int(helper) not in shm_segments.descendants(popen.pid)
        proc.stop(timeout=0.5)  # noted now, from the group alone: nothing was noted before
        assert shm_segments.group(popen.pid) == set()
        assert not segment.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(helper), 9)
        segment.unlink(missing_ok=True)
