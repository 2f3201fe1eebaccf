"""Data-plane grants as plain objects (:mod:`pdserve.store.grants`), and the tcp server's use
of them in-process: what it serves before and after it learns a segment's data key."""

from __future__ import annotations

import socket
import time
import uuid

import pytest

from pdserve.store import grants
from pdserve.store.grants import EXPIRED, FORGED, OP_READ, OP_WRITE, OUTSIDE, GrantKey
from pdserve.store.segment import SegmentMemory, shm_name
from pdserve.store.transports import tcp, tcp_server

KEY = bytes(range(32))
SEG = 0x1234_5678_9ABC_DEF0
NOW = 1_700_000_000_000


def _check(g: GrantKey, offset: int, length: int, op: int, grant: tuple, now: float = NOW):
    return g.check(SEG, offset, length, op, *grant, now)


def test_a_minted_grant_allows_its_range_and_sub_ranges_only() -> None:
    g = GrantKey(KEY)
    exp = NOW + 5000
    grant = (4096, 1000, exp, 7, g.mint(SEG, 4096, 1000, OP_READ, exp, 7))
    assert _check(g, 4096, 1000, OP_READ, grant) is None
    assert _check(g, 4096, 500, OP_READ, grant) is None  # the first of two pieces
    assert _check(g, 4596, 500, OP_READ, grant) is None  # the second
    assert _check(g, 4095, 1000, OP_READ, grant) == OUTSIDE
    assert _check(g, 4096, 1001, OP_READ, grant) == OUTSIDE
    assert _check(g, 5095, 2, OP_READ, grant) == OUTSIDE


def test_anything_but_the_minted_fields_is_forged() -> None:
    g = GrantKey(KEY)
    exp = NOW + 5000
    mac = g.mint(SEG, 0, 100, OP_READ, exp, 7)
    assert _check(g, 0, 100, OP_WRITE, (0, 100, exp, 7, mac)) == FORGED  # read grant, write
    assert _check(g, 0, 100, OP_READ, (0, 200, exp, 7, mac)) == FORGED  # stretched
    assert _check(g, 0, 100, OP_READ, (0, 100, exp + 1, 7, mac)) == FORGED  # extended
    assert _check(g, 0, 100, OP_READ, (0, 100, exp, 8, mac)) == FORGED  # another allocation
    flipped = bytes([mac[0] ^ 1]) + mac[1:]
    assert _check(g, 0, 100, OP_READ, (0, 100, exp, 7, flipped)) == FORGED
    assert _check(g, 0, 100, OP_READ, (0, 100, exp, 7, bytes(16))) == FORGED  # none
    assert g.check(SEG + 1, 0, 100, OP_READ, 0, 100, exp, 7, mac, NOW) == FORGED
    other = GrantKey(bytes(32))
    assert _check(other, 0, 100, OP_READ, (0, 100, exp, 7, mac)) == FORGED  # another key


def test_a_grant_expires() -> None:
    g = GrantKey(KEY)
    mac = g.mint(SEG, 0, 100, OP_WRITE, NOW, 1)
    assert _check(g, 0, 100, OP_WRITE, (0, 100, NOW, 1, mac), now=NOW) is None
    assert _check(g, 0, 100, OP_WRITE, (0, 100, NOW, 1, mac), now=NOW + 1) == EXPIRED


def test_segment_keys_differ_per_segment_and_master() -> None:
    m1, m2 = grants.new_master_key(), grants.new_master_key()
    assert m1 != m2 and len(m1) == grants.KEY_BYTES
    k = grants.segment_key_for(m1, "n0-seg0")
    assert len(k) == grants.KEY_BYTES
    assert k == grants.segment_key_for(m1, "n0-seg0")  # stable across remounts
    assert k != grants.segment_key_for(m1, "n0-seg1")
    assert k != grants.segment_key_for(m2, "n0-seg0")
    with pytest.raises(ValueError):
        GrantKey(b"short")


@pytest.fixture
def server():
    seg_id = f"grants-{uuid.uuid4().hex[:8]}-seg0"
    seg = SegmentMemory.create(seg_id, shm_name(seg_id), 1 << 20)
    srv = tcp_server.TcpServer(clock_skew_ms=0)
    srv.start([seg])
    yield srv, seg
    srv.stop()
    seg.unlink()


def _read(port: int, seg: int, offset: int, length: int, grant: tuple) -> int:
    head = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_READV, 0, 0, 0, 1)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head + tcp.RANGE.pack(seg, offset, length, *grant))
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
    magic, status, n = tcp.REP.unpack(got[: tcp.REP.size])
    assert magic == tcp.REP_MAGIC and len(got) == tcp.REP.size + (n if status == 0 else 0)
    return status


def test_the_tcp_server_refuses_everything_until_it_has_a_key(server) -> None:
    """Before the first mount answer no range is served; an empty key (data tokens off)
    serves any range; a key serves the ranges it granted."""
    srv, seg = server
    key = tcp.segment_key(seg.segment_id)
    assert _read(srv.port, key, 0, 10, tcp.NO_GRANT) == tcp.ST_FORBIDDEN
    srv.set_data_key(seg.segment_id, b"")
    assert _read(srv.port, key, 0, 10, tcp.NO_GRANT) == tcp.ST_OK
    srv.set_data_key(seg.segment_id, KEY)
    assert _read(srv.port, key, 0, 10, tcp.NO_GRANT) == tcp.ST_FORBIDDEN
    exp = int(time.time() * 1000) + 60_000
    mac = GrantKey(KEY).mint(key, 0, 10, OP_READ, exp, 3)
    assert _read(srv.port, key, 0, 10, (0, 10, exp, 3, mac)) == tcp.ST_OK
    old = int(time.time() * 1000) - 1
    mac = GrantKey(KEY).mint(key, 0, 10, OP_READ, old, 3)
    assert _read(srv.port, key, 0, 10, (0, 10, old, 3, mac)) == tcp.ST_EXPIRED
