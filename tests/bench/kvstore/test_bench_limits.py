"""``bench kvstore``'s local limits in tiny configurations, no store started: tcp-plain reads
distinct regions and receives the bytes sent; the raw disk rows read back what they wrote;
the page-cache drop a disk-tier run relies on empties the cache."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.kvstore import disk, limits


@pytest.mark.slow  # starts a peer process / ldconfig (ctypes.util.find_library)
def test_tcp_plain_cold_regions_receive_the_bytes_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small buffers for the test (the bench uses 256 MiB at least); the peer gets the size.
    monkeypatch.setattr(limits, "TCP_COLD_MIN_BYTES", 1 << 20)
    big = (8 << 20) + 3  # two streams (PARALLEL_MIN_BYTES), parts of unequal length
    # A batch of 4 x 4 KiB goes over one stream, of 4 x 64 KiB too, of 4 x big over two;
    # one peer per size serves its single and its batch rows.
    rows = limits.bench_tcp_limit([4096, 65536, big], 3, verify=True, batch=4)
    got = {(r.system, r.size, r.batch, r.mode) for r in rows}
    for size in (4096, 65536, big):
        for system in ("tcp-plain", "tcp-plain-warm"):
            assert {(system, size, 1, "single"), (system, size, 4, "batch")} <= got
    assert len(rows) == 12
    for r in rows:
        assert r.iterations == 3 and r.get_gbps > 0 and r.get_gbps == r.put_gbps


def test_tcp_plain_regions_are_distinct_and_never_repeat() -> None:
    assert limits.cold_regions(4096, 3) * 4096 >= limits.TCP_COLD_MIN_BYTES
    n = 200
    assert limits.cold_regions(1 << 20, n) >= n + 1  # every timed read its own region
    assert limits.cold_regions(1 << 30, 3) >= 2
    size = 4096
    a, b = limits.plain_pattern(0, size), limits.plain_pattern(size, 2 * size)
    assert not np.array_equal(a, b)
    assert np.array_equal(limits.plain_pattern(5, 13), limits.plain_pattern(0, 16)[5:13])


@pytest.mark.slow  # starts a peer process / ldconfig (ctypes.util.find_library)
def test_disk_raw_reads_back_what_it_wrote(tmp_path: Path) -> None:
    sizes = [4096, 1000, 65536]  # 1000: not a multiple of the O_DIRECT alignment
    rows = disk.bench_disk_raw(tmp_path, sizes, 3, verify=True, warm=True)
    got = {(r.system, r.size) for r in rows}
    for size in sizes:
        assert {("disk-raw", size), ("disk-raw-warm", size)} <= got
        if disk.fs_type(tmp_path) in ("ext4", "xfs", "btrfs"):
            assert ("disk-raw-direct", size) in got
    for r in rows:
        assert r.iterations == 3 and r.mode == "single" and r.batch == 1
        assert r.put_gbps > 0 and r.get_gbps > 0 and 0 < r.get_p50_us <= r.get_p99_us
    assert list(tmp_path.iterdir()) == []  # its files removed


def test_disk_raw_verify_catches_a_changed_byte(tmp_path: Path) -> None:
    import mmap

    path, size, n = tmp_path / "objects", 4096, 3
    buf = mmap.mmap(-1, size)
    disk._write(path, size, n, buf, direct=False)
    disk._read(path, size, n, buf, direct=False, verify=True)
    with open(path, "r+b") as f:
        f.seek(size + 7)
        old = f.read(1)
        f.seek(size + 7)
        f.write(bytes([old[0] ^ 0xFF]))
    with pytest.raises(RuntimeError, match="object 1"):
        disk._read(path, size, n, buf, direct=False, verify=True)


@pytest.mark.slow  # starts a peer process / ldconfig (ctypes.util.find_library)
def test_drop_cache_empties_the_page_cache_of_a_file_and_a_directory(tmp_path: Path) -> None:
    if disk.memory_backed(tmp_path):
        pytest.skip(f"{tmp_path} is on {disk.fs_type(tmp_path)}: its pages are the file")
    sub = tmp_path / "d"
    sub.mkdir()
    files = [tmp_path / "one", sub / "two"]
    for p in files:
        p.write_bytes(os.urandom(1 << 20))
        p.read_bytes()
    before = disk.resident_fraction(files[0])
    if before != before:  # nan: mincore refused
        pytest.skip("mincore cannot tell here")
    assert before > 0.9
    disk.drop_cache(files[0])
    assert disk.resident_fraction(files[0]) < disk.RESIDENT_WARN
    assert disk.resident_fraction(files[1]) > 0.9
    disk.drop_cache(tmp_path)  # every file under a directory
    assert disk.resident_fraction(files[1]) < disk.RESIDENT_WARN


def test_fs_type_tells_memory_from_disk() -> None:
    assert disk.fs_type("/proc/self") == "proc"
    if os.path.isdir("/dev/shm") and disk.fs_type("/dev/shm") == "tmpfs":
        assert disk.memory_backed("/dev/shm")
    assert not disk.memory_backed("/proc")
