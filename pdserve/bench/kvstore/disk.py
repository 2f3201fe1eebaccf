"""The disk limit a store's disk tier is read against: the same bytes read straight from a
file on the same file system, nothing else.

:func:`bench_disk_raw` writes a file of distinct random objects in a directory and reads
each object once, in the order written (as ``bench kvstore`` reads the keys it put), timed
per read, two ways:

* ``disk-raw-direct``: ``O_DIRECT`` preads into a page-aligned buffer, the page cache
  bypassed: what the device gives. Left out (and said) where the file system refuses
  ``O_DIRECT`` (EINVAL: tmpfs before Linux 6.6, some FUSE and overlay mounts).
* ``disk-raw``: buffered preads after ``posix_fadvise(POSIX_FADV_DONTNEED)`` of the whole
  file (written and fsynced first: dirty pages are never dropped), so every page comes from
  the device, without root (no ``drop_caches``); the kernel's readahead works as it would
  for a disk tier's buffered reads in the same order (small objects read one after the
  other mostly come from the readahead of the ones before: the best case of a buffered
  read, so a bound; ``disk-raw-direct`` is the cost of each read on its own). How much of
  the file is still cached after the drop is checked (``mincore``) and a warning printed
  when more than a few percent is.

put: each object's write (``pwrite``; ``O_DIRECT`` for the direct row, from the aligned
buffer) and one ``fsync`` at the end: GB/s over all the writes and the fsync, p50/p99 per
write. get: GB/s over the reads' own time, p50/p99 per read.

:func:`drop_cache` is the same eviction for any file (a disk tier's own files), so that a
disk-tier run can be read cold against these rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import time
from pathlib import Path

import numpy as np

from pdserve.bench.kvstore.measure import Row, fmt_size, iterations_for, progress, timed_row
from pdserve.store.segment import fs_type, memory_backed

#: O_DIRECT's alignment of offsets, lengths and buffers here (the page size covers every
#: logical block size in use).
ALIGN = mmap.PAGESIZE
#: The most of a file that may still be cached after :func:`drop_cache` without a warning.
RESIDENT_WARN = 0.05


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return [path]


def drop_cache(path: str | os.PathLike) -> None:
    """Evicts ``path`` (a file, or every file under a directory) from the page cache:
    ``fdatasync`` (``POSIX_FADV_DONTNEED`` leaves dirty pages), then DONTNEED of the whole
    file. No root needed; pages another process has mapped and locked stay. A no-op on
    tmpfs, whose pages are the file."""
    for p in _files(Path(path)):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            with contextlib.suppress(OSError):
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: str | os.PathLike) -> float:
    """The share of ``path``'s pages in the page cache now (``mincore`` of a mapping of it,
    nothing read); ``nan`` when it cannot be told."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
            return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def raw_object(size: int, i: int) -> bytes:
    """Object ``i`` of ``size`` bytes of :func:`bench_disk_raw`'s file: random, distinct."""
    return np.random.default_rng([size, i]).bytes(size)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(errno.EIO, f"short read at {offset}")
        view, offset = view[got:], offset + got


def _fit(directory: Path, size: int, n: int) -> int:
    """``n``, fewer where the file would take more than half the free space (at least 3)."""
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize // 2
    stride = _round_up(size)
    if n * stride <= room:
        return n
    fit = room // stride
    if fit < 3:
        raise SystemExit(f"--disk-dir {directory}: no room for 3 objects of {fmt_size(size)}")
    progress(f"disk-raw {fmt_size(size)}: {fit} objects instead of {n}, to fit {directory}")
    return fit


def _write(
    path: Path, size: int, n: int, buf: mmap.mmap, direct: bool
) -> tuple[list[float], float]:
    """Writes objects 0..n-1 at multiples of the aligned stride, then fsyncs: each write's
    seconds, and all of them plus the fsync."""
    stride = _round_up(size)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    view = memoryview(buf)
    lat = []
    try:
        buf[stride - ALIGN : stride] = bytes(ALIGN)  # the padding past a size not aligned
        for i in range(n):
            buf[:size] = raw_object(size, i)
            src = view[:stride] if direct else view[:size]
            t = time.perf_counter()
            _pwrite_all(fd, src, i * stride)
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        os.fsync(fd)
        sync = time.perf_counter() - t
    finally:
        os.close(fd)
    return lat, sum(lat) + sync


def _read(
    path: Path, size: int, n: int, buf: mmap.mmap, direct: bool, verify: bool
) -> tuple[list[float], float]:
    """Reads objects 0..n-1 once each into ``buf``: each read's seconds, and their sum."""
    stride = _round_up(size)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    view = memoryview(buf)
    dst = view[:stride] if direct else view[:size]
    lat = []
    try:
        for i in range(n):
            t = time.perf_counter()
            _pread_all(fd, dst, i * stride)
            lat.append(time.perf_counter() - t)
            if verify and buf[:size] != raw_object(size, i):
                raise RuntimeError(f"{path.name}: object {i} read back different bytes")
    finally:
        os.close(fd)
    return lat, sum(lat)


def bench_disk_raw(
    directory: str | os.PathLike,
    sizes: list[int],
    iterations: int,
    verify: bool = False,
    warm: bool = False,
) -> list[Row]:
    """``disk-raw-direct`` and ``disk-raw`` rows per size (see the module), files written in
    ``directory`` and removed after. ``verify``: check every object read equals the one
    written (outside the timing). ``warm``: also a ``disk-raw-warm`` row, the buffered file
    read again from the page cache (what the drop is checked against)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if memory_backed(directory):
        progress(f"disk-raw: {directory} is on {fs_type(directory)}: the rows measure memory")
    rows: list[Row] = []
    direct_ok = True
    for size in sizes:
        n = _fit(directory, size, iterations_for(size, iterations))
        stride = _round_up(size)
        buf = mmap.mmap(-1, stride)  # page-aligned: O_DIRECT's source and destination
        base = directory / f".pdserve-disk-raw-{os.getpid()}-{size}"
        progress(f"disk-raw {fmt_size(size)} x {n} in {directory}")
        if direct_ok:
            path = base.with_suffix(".direct")
            try:
                put = _write(path, size, n, buf, direct=True)
                drop_cache(path)  # nothing cached by O_DIRECT writes; a no-op, to be sure
                get = _read(path, size, n, buf, direct=True, verify=verify)
                rows.append(timed_row("disk-raw-direct", size, n, put, get))
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct_ok = False
                progress(f"disk-raw: {directory} refuses O_DIRECT ({e}): no disk-raw-direct rows")
            finally:
                path.unlink(missing_ok=True)
        path = base.with_suffix(".buffered")
        try:
            put = _write(path, size, n, buf, direct=False)
            drop_cache(path)
            left = resident_fraction(path)
            if left > RESIDENT_WARN:
                progress(
                    f"disk-raw {fmt_size(size)}: {left:.0%} of the file still cached after "
                    "POSIX_FADV_DONTNEED: disk-raw reads partly from memory"
                )
            get = _read(path, size, n, buf, direct=False, verify=verify)
            rows.append(timed_row("disk-raw", size, n, put, get))
            if warm:
                get = _read(path, size, n, buf, direct=False, verify=verify)
                rows.append(timed_row("disk-raw-warm", size, n, put, get))
        finally:
            path.unlink(missing_ok=True)
    return rows


__all__ = ["bench_disk_raw", "drop_cache", "fs_type", "memory_backed", "raw_object"]
