"""An object's checksum, recorded by its writer and checked by every reader."""

from __future__ import annotations

import blake3

#: Objects from this size on are hashed on every core (BLAKE3's tree mode: same digest).
PARALLEL_HASH_BYTES = 4 << 20


def checksum(data: memoryview) -> bytes:
    """BLAKE3, first 16 bytes (the GIL is released while it runs)."""
    threads = blake3.blake3.AUTO if len(data) >= PARALLEL_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).digest(length=16)
