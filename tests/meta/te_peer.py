"""A Mooncake TransferEngine in its own process, configured with pdserve meta's HTTP metadata
endpoint (used by test_mooncake_te.py; not a test module).

target:    te_peer.py target URL NAME SIZE SEED   -> prints "READY <ptr>", waits for a stdin
           line, then prints "SHA <sha256 of its buffer>".
initiator: te_peer.py initiator URL NAME SIZE SEED TARGET PTR -> reads the target's buffer
           (must equal the SEED bytes), writes SEED+1 bytes into it, prints "OK".
"""

from __future__ import annotations

import hashlib
import random
import sys

from mooncake.engine import TransferEngine


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def main() -> int:
    mode, url, name, size, seed = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
    te = TransferEngine()
    if te.initialize(name, url, "tcp", "") != 0:
        print("FAIL initialize", flush=True)
        return 1
    ptr = te.allocate_managed_buffer(size)
    if mode == "target":
        te.write_bytes_to_buffer(ptr, pattern(seed, size), size)
        print(f"READY {ptr}", flush=True)
        sys.stdin.readline()
        print("SHA", hashlib.sha256(te.read_bytes_from_buffer(ptr, size)).hexdigest(), flush=True)
        return 0
    target, remote = sys.argv[6], int(sys.argv[7])
    if te.transfer_sync_read(target, ptr, remote, size) != 0:
        print("FAIL read", flush=True)
        return 1
    if te.read_bytes_from_buffer(ptr, size) != pattern(seed, size):
        print("FAIL read bytes differ", flush=True)
        return 1
    te.write_bytes_to_buffer(ptr, pattern(seed + 1, size), size)
    if te.transfer_sync_write(target, ptr, remote, size) != 0:
        print("FAIL write", flush=True)
        return 1
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
