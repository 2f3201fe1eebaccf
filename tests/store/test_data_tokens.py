"""Data-plane tokens on real master and node processes: the node's tcp data port serves a
range only with a valid grant from the master (raw sockets here, as an attacker would talk
to it), the client's normal paths carry them, ``data_tokens: false`` turns the check off, and
a node learns a restarted master's new key when it remounts."""

from __future__ import annotations

import os
import socket
import time

import pytest

from pdserve import errors, procs
from pdserve.store import open_store
from pdserve.store.client import StoreClient
from pdserve.store.transports import tcp
from pdserve.v1 import kvstore_pb2 as pb

SIZE = 64 * 1024  # above the master's inline limit: read from a node


def _exchange(port: int, op: int, ranges: list[tuple], payload: bytes = b"") -> tuple[int, bytes]:
    """One raw READV / WRITEV of ``ranges`` (segment key, offset, length, grant...): the
    reply's status and what followed it. A refusal must be the reply header alone (the node
    then closes the connection)."""
    head = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, op, 0, 0, 0, len(ranges))
    table = b"".join(tcp.RANGE.pack(*r) for r in ranges)
    if op == tcp.OP_WRITEV:
        table += tcp.writev_pad(len(ranges))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head + table + payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(1 << 20):
            got += chunk
    magic, status, _n = tcp.REP.unpack(got[: tcp.REP.size])
    assert magic == tcp.REP_MAGIC
    if status != tcp.ST_OK:
        assert len(got) == tcp.REP.size, "a refusal is followed by nothing"
    return status, got[tcp.REP.size :]


def _grant(rep: pb.Replica) -> tuple:
    return rep.offset, rep.size, rep.token_expires_ms, rep.alloc_id, rep.token


def _read_replica(
    client: StoreClient, key: str, lease_ms: int = 0, client_id: str = ""
) -> pb.Replica:
    resp = client.master.call(
        "BatchGetReplicaList",
        pb.BatchGetReplicaListRequest(
            client_id=client_id or client.client_id, keys=[key], lease_ms=lease_ms
        ),
    )
    client.leases.release([key])
    return resp.results[0].replicas[0]


def _write_replica(client: StoreClient, key: str) -> pb.Replica:
    resp = client.master.call(
        "BatchPutStart",
        pb.BatchPutStartRequest(
            client_id=client.client_id, items=[pb.PutStartItem(key=key, size=SIZE)]
        ),
    )
    assert resp.results[0].code == pb.KV_OK
    return resp.results[0].replicas[0]


@pytest.mark.slow
def test_the_node_refuses_ranges_without_a_valid_grant(cluster_factory):
    c = cluster_factory()
    node = c.add_node(transports="tcp", segment_sizes="4MiB,4MiB", grant_clock_skew_ms=0)
    port = node.info["tcp_port"]
    with open_store(c.address, transport="tcp") as client:
        a, b = os.urandom(SIZE), os.urandom(SIZE)
        assert client.batch_put([("a", a), ("b", b)]) == [True, True]
        ra, rb = _read_replica(client, "a"), _read_replica(client, "b")
        seg, seg_b = tcp.segment_key(ra.segment_id), tcp.segment_key(rb.segment_id)
        other_seg = next(tcp.segment_key(s) for s in node.info["segments"] if s != ra.segment_id)
        good = (seg, ra.offset, ra.size, *_grant(ra))
        assert _exchange(port, tcp.OP_READV, [good]) == (tcp.ST_OK, a)
        piece = (seg, ra.offset + 100, 1000, *_grant(ra))  # a sub-range of the grant
        assert _exchange(port, tcp.OP_READV, [piece]) == (tcp.ST_OK, a[100:1100])

        off, size, exp, alloc, mac = _grant(ra)
        forged = bytes([mac[0] ^ 0x80]) + mac[1:]
        refused = {
            "no token": [(seg, off, size, *tcp.NO_GRANT)],
            "a forged MAC": [(seg, off, size, off, size, exp, alloc, forged)],
            "another object's range": [(seg_b, rb.offset, rb.size, *_grant(ra))],
            "a stretched grant": [(seg, off, size + 64, off, size + 64, exp, alloc, mac)],
            "a later expiry": [(seg, off, size, off, size, exp + 60_000, alloc, mac)],
            "another allocation": [(seg, off, size, off, size, exp, alloc + 1, mac)],
            "another segment": [(other_seg, off, size, *_grant(ra))],
            "a good range with a bad one": [good, (seg, off, size, *tcp.NO_GRANT)],
        }
        for why, ranges in refused.items():
            assert _exchange(port, tcp.OP_READV, ranges)[0] == tcp.ST_FORBIDDEN, why
        # A read grant does not write, a write grant does not read.
        assert _exchange(port, tcp.OP_WRITEV, [good], bytes(SIZE))[0] == tcp.ST_FORBIDDEN
        rw = _write_replica(client, "w")
        wgood = (tcp.segment_key(rw.segment_id), rw.offset, rw.size, *_grant(rw))
        assert _exchange(port, tcp.OP_READV, [wgood])[0] == tcp.ST_FORBIDDEN
        w = os.urandom(SIZE)
        assert _exchange(port, tcp.OP_WRITEV, [wgood], w) == (tcp.ST_OK, b"")
        # An expired grant (a 1 ms lease; this node allows no clock skew). Another client
        # id: the client's own earlier lease may not be released yet, and a lease only grows.
        late = _read_replica(client, "a", lease_ms=1, client_id="late-reader")
        time.sleep(0.05)
        expired = (seg, late.offset, late.size, *_grant(late))
        assert _exchange(port, tcp.OP_READV, [expired])[0] == tcp.ST_EXPIRED
        # Nothing refused touched a byte, and the client still reads through.
        assert client.batch_get(["a", "b"]) == [a, b]


@pytest.mark.slow
def test_the_client_paths_carry_their_grants(cluster_factory):
    """get / put / batches, over tcp (a big object as pieces on parallel connections, each
    within the one grant) and shm, with data tokens on."""
    c = cluster_factory()
    c.add_node(transports="shm,tcp", segment_sizes="48MiB")
    objects = {
        "small": os.urandom(SIZE),
        "mid": os.urandom(3 << 20),
        "big": os.urandom(tcp.PARALLEL_MIN_BYTES + 12345),
    }
    with open_store(c.address, transport="tcp") as client:
        assert client.batch_put(list(objects.items())) == [True] * 3
        assert client.batch_get(list(objects)) == list(objects.values())
        assert client.get("big") == objects["big"]
        assert client.put("one", objects["small"]) and client.get("one") == objects["small"]
        buf = bytearray(SIZE)
        assert client.get_into("one", memoryview(buf)) == SIZE and bytes(buf) == objects["small"]
        rep = _read_replica(client, "small")
        assert len(rep.token) == 16 and rep.alloc_id > 0
        assert rep.token_expires_ms > time.time() * 1000
    with open_store(c.address) as client:  # shm on this host: no per-request check there
        assert client.batch_get(list(objects)) == list(objects.values())


@pytest.mark.slow
def test_with_data_tokens_off_the_node_serves_any_range(cluster_factory):
    c = cluster_factory(data_tokens=False)
    node = c.add_node(transports="tcp", segment_sizes="4MiB")
    with open_store(c.address, transport="tcp") as client:
        data = os.urandom(SIZE)
        assert client.put("a", data) and client.get("a") == data
        rep = _read_replica(client, "a")
        assert rep.token == b"" and rep.token_expires_ms == 0
        seg = tcp.segment_key(rep.segment_id)
        plain = (seg, rep.offset, rep.size, *tcp.NO_GRANT)
        assert _exchange(node.info["tcp_port"], tcp.OP_READV, [plain]) == (tcp.ST_OK, data)


@pytest.mark.slow
def test_a_node_learns_a_restarted_masters_key(tmp_path):
    """The master's key is new at every start: after a restart the node's remount brings it
    the new key; grants of the old master are refused, the new master's are served."""
    state = tmp_path / "state"
    master = procs.start_master(tmp_path / "logs", state_dir=state)
    address = master.info["grpc"]
    node = procs.start_node(address, tmp_path / "logs", segment_sizes="4MiB", transports="tcp")
    port = node.info["tcp_port"]
    try:
        with open_store(address, transport="tcp") as client:
            data = os.urandom(SIZE)
            assert client.put("a", data)
            old = _read_replica(client, "a")
            seg = tcp.segment_key(old.segment_id)
            old_range = (seg, old.offset, old.size, *_grant(old))
            assert _exchange(port, tcp.OP_READV, [old_range]) == (tcp.ST_OK, data)
            master.stop()
            master = procs.start_master(
                tmp_path / "logs2", state_dir=state, port=address.rsplit(":", 1)[1]
            )
            deadline = time.monotonic() + 10
            while True:  # the node remounts on its next heartbeat; the object comes back
                try:
                    if client.get("a") == data:
                        break
                except errors.PdserveError:
                    pass
                assert time.monotonic() < deadline, "the node did not remount"
                time.sleep(0.2)
            new = _read_replica(client, "a")
            assert new.token != old.token
            assert _exchange(port, tcp.OP_READV, [old_range])[0] == tcp.ST_FORBIDDEN
            new_range = (seg, new.offset, new.size, *_grant(new))
            assert _exchange(port, tcp.OP_READV, [new_range]) == (tcp.ST_OK, data)
    finally:
        node.stop()
        procs.remove_shm(node)
        master.stop()
