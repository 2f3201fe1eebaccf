"""Node-side segment memory: one file per segment.

A memory segment lives in a file under ``/dev/shm`` whose name is derived from the node id and
the segment id, so a client on the same host can map the very same pages (the shm transport)
while the tcp and mooncake transports serve from the same mapping. A disk segment (the tier
below memory) is the same kind of file in a directory on the node's disk, mapped the same
way: the tcp transport serves it, the kernel's page cache and readahead stand between it and
the device. The node owns the file: it creates it (mode 0600: only processes of the node's
Unix user can map it); it unlinks a memory segment's on clean shutdown and keeps a disk
segment's, which a restarted node maps again with its bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import errors

SHM_DIR = Path("/dev/shm")
#: Every segment file's name starts with this (:func:`shm_name`).
SHM_PREFIX = "pdserve-kv-"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[A-Za-z0-9_.-]+")


#: What follows the node id in the id of a segment it owns.
_OWN_SEGMENT = re.compile(r"-(?:seg|disk)\d+")


def shm_name(segment_id: str) -> str:
    """Stable shared-memory file name of a segment (its id already carries the node id, see
    :mod:`pdserve.services.kvstore.node.node`); filesystem-safe, no slashes."""
    return _UNSAFE.sub("_", f"{SHM_PREFIX}{segment_id}")


def belongs_to(segment_id: str, node_id: str) -> bool:
    """Whether ``segment_id`` is one of the ids node ``node_id`` names its segments
    (``<node id>-seg<i>``, ``<node id>-disk<i>``; :mod:`pdserve.services.kvstore.node.node`).
    Exact: node ``node-1`` owns ``node-1-seg0``, not ``node-1-x-seg0`` (node ``node-1-x``'s)."""
    return segment_id.startswith(node_id) and bool(_OWN_SEGMENT.fullmatch(segment_id, len(node_id)))


def is_shm_name(name: str) -> bool:
    """Whether ``name`` is one :func:`shm_name` could have made (the prefix, no path
    separators): a client maps nothing else under SHM_DIR, whatever a replica says."""
    return _SHM_NAME.fullmatch(name) is not None


#: File systems whose files live in memory: a disk tier there is memory.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "shm"})


def fs_type(path: str | os.PathLike) -> str:
    """The type of the file system ``path`` is on (``ext4``, ``xfs``, ``tmpfs``, ...), from
    the longest mount point in ``/proc/self/mounts`` above it; ``""`` when unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[1])  # \040
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def memory_backed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on a file system held in memory (tmpfs, /dev/shm, ramfs)."""
    return fs_type(path) in MEMORY_FS


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


class SegmentInUse(errors.FailedPrecondition):
    """Another live process owns this segment's shared-memory file (a duplicate node id)."""


@dataclass
class SegmentMemory:
    """A node's segment: an mmap of ``SHM_DIR / name`` of ``size`` bytes.

    The owner holds an exclusive ``flock`` on the file for its lifetime, so a second node with
    the same id cannot clobber it. The file of a node that was killed (no clean unlink) keeps
    its bytes; a node restarted with the same id and size maps them again (``reused``), so a
    segment id always names the same bytes, as the master assumes on a remount."""

    segment_id: str
    name: str
    size: int
    mm: mmap.mmap = field(repr=False)
    fd: int = field(repr=False, default=-1)
    #: True when the bytes of a previous owner (same name and size) were kept.
    reused: bool = False
    #: The directory of the file: SHM_DIR for a memory segment, the disk tier's otherwise.
    directory: Path = SHM_DIR

    @property
    def on_disk(self) -> bool:
        """Whether this is a disk-tier segment (a file outside SHM_DIR)."""
        return self.directory != SHM_DIR

    @property
    def path(self) -> Path:
        return self.directory / self.name

    @classmethod
    def create(
        cls,
        segment_id: str,
        name: str,
        size: int,
        *,
        prefault: bool = False,
        directory: Path = SHM_DIR,
    ) -> SegmentMemory:
        """Creates the file ``directory / name`` (or takes over a leftover of a dead owner) and
        maps it. ``prefault`` allocates every page now (``posix_fallocate``: a too small
        /dev/shm or disk fails here with ENOSPC instead of a SIGBUS on a later write) and maps
        them all (``MAP_POPULATE``), so copies do not pay page faults. Raises
        :class:`SegmentInUse` when a live process owns the file."""
        path = directory / name
        # No symlinks, and only a file of our own: another user's file in the world-writable
        # SHM_DIR (made before us under this name) must not become our segment.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise errors.FailedPrecondition(
                    f"shared-memory segment {path} belongs to another user; remove it"
                )
            os.fchmod(fd, 0o600)  # a leftover of an older run may have been wider
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise SegmentInUse(
                    f"shared-memory segment {path} is owned by a running process "
                    "(is another node running with the same node id?)"
                ) from exc
            reused = os.fstat(fd).st_size == size
            if not reused:
                # A leftover of another size holds nothing a master could still point at
                # validly: start from zeros.
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED
            if prefault:
                os.posix_fallocate(fd, 0, size)
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(segment_id, name, size, mm, fd, reused, directory)

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm)

    @property
    def address(self) -> int:
        """Virtual address of the mapping (for registering it with a transfer engine)."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def write(self, offset: int, data: memoryview) -> None:
        """Copies ``data`` to ``offset``. A disk segment's copy goes through the file
        (``pwrite``, then ``fdatasync``: durable when this returns, and the pages are not
        mapped into this process, so the kernel may drop them from its cache like any file's);
        a memory segment's is a memcpy into the mapping."""
        if not self.on_disk:
            with self.view as whole:
                whole[offset : offset + len(data)] = data
            return
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)
        os.fdatasync(self.fd)

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Copies ``len(dest)`` bytes from ``offset`` into ``dest``. A disk segment reads its
        file (``preadv``, with readahead: a cold mapping would fault in a page at a time), a
        memory segment copies from its mapping."""
        if not self.on_disk:
            with self.view as whole:
                dest[:] = whole[offset : offset + len(dest)]
            return
        done = 0
        while done < len(dest):
            got = os.preadv(self.fd, [dest[done:]], offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"{self.path} ends {len(dest) - done} bytes short")
            done += got

    def unlink(self) -> None:
        """Removes the shm file of a memory segment (the mapping stays valid until the process
        exits); a disk segment's file stays for the next run."""
        if self.on_disk:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
