"""A worker finds the shared-memory segments its engine's processes map, and only those, and
removes what outlives them."""

from __future__ import annotations

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


SERVICE = """
import signal, sys, time
from multiprocessing import resource_tracker, shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a shutdown that does not end: SIGKILL follows
own = shared_memory.SharedMemory(create=True, size=4096)
shared = shared_memory.SharedMemory(create=True, size=4096)
for m in (own, shared):
    resource_tracker.unregister(m._name, "shared_memory")  # as a killed engine leaves them
print(own.name, shared.name, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_service_killed_in_its_shutdown_leaves_no_segment_but_those_still_mapped(
    tmp_path: Path,
) -> None:
    """ServiceProcess.stop SIGKILLs a service whose shutdown does not end (its group with it,
    Python's resource tracker included) and then removes the segments the service mapped,
    except one another live process (this one) still maps."""
    from pdserve.procs import ServiceProcess

    popen = subprocess.Popen(
        [sys.executable, "-c", SERVICE],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc = ServiceProcess("svc", popen, tmp_path / "svc.log")
    own, shared = popen.stdout.readline().split()
    ours = shared_memory.SharedMemory(name=shared)  # mapped here too: in use
    try:
        proc.note_segments()
        assert proc.segments == {own, shared}
        assert proc.stop(timeout=0.5) == -9
        assert not (Path("/dev/shm") / own).exists()
        assert (Path("/dev/shm") / shared).exists()
        assert proc.segments == set()
    finally:
        popen.kill()
        ours.close()
        ours.unlink()
        (Path("/dev/shm") / own).unlink(missing_ok=True)
