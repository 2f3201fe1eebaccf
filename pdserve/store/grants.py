"""Data-plane grants: the short-lived capabilities with which the master lets a client at one
replica's bytes, and with which a storage node checks every tcp request range.

A grant names one byte range of one segment (an allocation: a replica's offset and size),
one operation (:data:`OP_READ` or :data:`OP_WRITE`), an expiry (unix wall-clock ms) and the
allocation's id (a counter the master increments per placement, so two allocations of the
same range get different grants). Its token is a MAC over those fields, keyed with the
segment's *data key*. The master derives each segment's data key from its own random key
(:func:`segment_key_for`) and hands it to the node in the MountSegment answer, so a node
holds only the keys of its own segments and cannot mint grants for another node's.

A request range is allowed when it lies inside its grant (sub-ranges are fine: the client
splits big objects over several connections), the MAC matches (compared in constant time),
the operation is the grant's, and the grant has not expired (give or take the node's clock
skew allowance). The node does not know the master's allocations: a grant stays good until
it expires even when its range was freed earlier (a revoked put, a removed object). Read
grants expire with the read lease, which keeps the object from being evicted or removed until
then; write grants with the put's timeout, so a writer can still change its object's bytes
after committing it until then, which readers catch with the object's checksum.

MAC: keyed BLAKE2b (:mod:`hashlib`, 16-byte digest), not keyed BLAKE3. Both are PRFs made for
keyed use; BLAKE2b comes with Python (nothing to install on a node) and the key's block is
hashed once per segment: :class:`GrantKey` keeps the keyed state and copies it per MAC, about
0.45 us for the 45-byte message on the machine this was written on (keyed BLAKE3 0.55 us,
keyed BLAKE2b from scratch 0.9 us).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

OP_READ = 1
OP_WRITE = 2
#: Bytes of the master's key and of each segment's data key.
KEY_BYTES = 32
#: Bytes of a grant's MAC (the token).
MAC_BYTES = 16
#: What the MAC covers: tag | segment key u64 | offset u64 | length u64 | op u8 | expiry ms
#: u64 | allocation id u64 (little-endian). The tag names the format, so a MAC of another
#: format (or another use of the key) never verifies as a grant.
FIELDS = struct.Struct("<4sQQQBQQ")
TAG = b"PDG1"
#: Why :meth:`GrantKey.check` refused a range.
OUTSIDE = "range outside its grant"
FORGED = "grant MAC does not match (forged, or for another segment, op or key)"
EXPIRED = "grant expired"


def new_master_key() -> bytes:
    """The master's random key, made at every start (never stored: nodes remount after a
    master restart and learn the keys derived from the new one)."""
    return secrets.token_bytes(KEY_BYTES)


def segment_key_for(master_key: bytes, segment_id: str) -> bytes:
    """The data key of ``segment_id``: keyed BLAKE2b of its id under the master's key."""
    return hashlib.blake2b(
        segment_id.encode(), key=master_key, digest_size=KEY_BYTES, person=b"pdserve-data-key"
    ).digest()


class GrantKey:
    """Mints and checks the grants of one segment under its data key. Thread-safe (each MAC
    works on a copy of the keyed state)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a data key has {KEY_BYTES} bytes, got {len(key)}")
        self._keyed = hashlib.blake2b(key=key, digest_size=MAC_BYTES)

    def mint(
        self, seg: int, offset: int, length: int, op: int, expires_ms: int, alloc_id: int
    ) -> bytes:
        """The MAC of a grant: segment key ``seg`` (the tcp protocol's u64), ``[offset,
        offset + length)``, ``op``, expiry (unix ms) and allocation id."""
        h = self._keyed.copy()
        h.update(FIELDS.pack(TAG, seg, offset, length, op, expires_ms, alloc_id))
        return h.digest()

    def check(
        self,
        seg: int,
        offset: int,
        length: int,
        op: int,
        grant_offset: int,
        grant_length: int,
        expires_ms: int,
        alloc_id: int,
        mac: bytes,
        now_ms: float,
    ) -> str | None:
        """None when ``op`` on ``[offset, offset + length)`` of ``seg`` is inside the grant
        ``(grant_offset, grant_length, expires_ms, alloc_id, mac)`` and the grant is valid at
        ``now_ms`` (the caller subtracts its clock skew allowance); else why not
        (:data:`OUTSIDE`, :data:`FORGED` or :data:`EXPIRED`)."""
        if offset < grant_offset or offset + length > grant_offset + grant_length:
            return OUTSIDE
        want = self.mint(seg, grant_offset, grant_length, op, expires_ms, alloc_id)
        if not hmac.compare_digest(want, mac):
            return FORGED
        if expires_ms < now_ms:
            return EXPIRED
        return None
