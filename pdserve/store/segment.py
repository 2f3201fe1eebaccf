"""Node-side segment memory: one shared-memory file per segment.

Every segment lives in a file under ``/dev/shm`` whose name is derived from the node id and
the segment id, so a client on the same host can map the very same pages (the shm transport)
while the tcp and mooncake transports serve from the same mapping. The node owns the file:
it creates it, and unlinks it on clean shutdown.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """Parses ``"256MiB"``, ``"1GiB"``, ``"4096"`` or an int into bytes (> 0)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"invalid size {text!r}: expected e.g. 4096, 64MiB or 1GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def shm_name(segment_id: str) -> str:
    """Stable shared-memory file name of a segment (its id already carries the node id, see
    :mod:`pdserve.services.kvstore.node`); filesystem-safe, no slashes."""
    return _UNSAFE.sub("_", f"pdserve-kv-{segment_id}")


def host_id() -> str:
    """A stable id of this host: ``PDSERVE_HOST_ID`` when set, else /etc/machine-id plus the
    boot id (shared memory does not survive a reboot), else the hostname."""
    env = os.environ.get("PDSERVE_HOST_ID")
    if env:
        return env
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        with contextlib.suppress(OSError):
            parts.append(Path(path).read_text().strip())
    return "-".join(parts) or socket.gethostname()


@dataclass
class SegmentMemory:
    """A node's segment: an mmap of ``SHM_DIR / name`` of ``size`` bytes."""

    segment_id: str
    name: str
    size: int
    mm: mmap.mmap = field(repr=False)

    @classmethod
    def create(
        cls, segment_id: str, name: str, size: int, *, prefault: bool = False
    ) -> SegmentMemory:
        """Creates (or replaces a stale leftover of) the file and maps it. ``prefault`` touches
        every page now: the memory is committed at start (a full /dev/shm fails here, not
        with SIGBUS on a later write) and writes do not pay page faults."""
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(segment_id, name, size, mm)
        if prefault:
            seg.prefault()
        return seg

    def prefault(self, step: int = 64 * 1024 * 1024) -> None:
        import numpy as np

        arr = np.frombuffer(self.mm, dtype=np.uint8)
        for off in range(0, self.size, step):
            arr[off : off + step] = 0

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm)

    @property
    def address(self) -> int:
        """Virtual address of the mapping (for registering it with a transfer engine)."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def unlink(self) -> None:
        """Removes the shm file (the mapping stays valid until the process exits)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)
