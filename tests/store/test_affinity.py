"""Where a node serves the streams of a same-host transfer (:mod:`pdserve.store.affinity`): a
request flagged as one of a transfer's parallel streams is served on the CPU it came from,
anything else on the thread's own CPUs. Driven through an in-process tcp server (its serving
threads are this process's, so their CPUs can be read) and pdserve's real tcp client."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pdserve.store import affinity
from pdserve.store.segment import SegmentMemory, shm_name
from pdserve.store.transports import tcp, tcp_client, tcp_server
from pdserve.v1 import kvstore_pb2

SEG_BYTES = 4 << 20
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

needs_two_cpus = pytest.mark.skipif(
    not affinity.SUPPORTED or len(CPUS) < 2, reason="needs Linux thread affinity and 2 CPUs"
)


def _server(follow: bool):
    seg_id = f"affinity-{uuid.uuid4().hex[:8]}-seg0"
    seg = SegmentMemory.create(seg_id, shm_name(seg_id), SEG_BYTES)
    np.frombuffer(seg.mm, dtype=np.uint8)[:] = np.arange(SEG_BYTES, dtype=np.uint64).astype(
        np.uint8
    )
    srv = tcp_server.TcpServer(follow_cpu=follow)
    srv.start([seg])
    srv.set_data_key(seg_id, b"")
    return srv, seg


def _serving_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kv-tcp-conn" and t.is_alive()}


@pytest.fixture(params=[True, False], ids=["follow", "no-follow"])
def node(request):
    """An in-process tcp server (following same-host streams or not), its segment, whether
    it follows, and a function that answers the CPUs each of its serving threads may run on
    (serving threads of other tests' servers in this process are left out)."""
    srv, seg = _server(request.param)
    others = _serving_threads()

    def serving_cpus() -> list[set[int]]:
        return [os.sched_getaffinity(t.native_id) for t in _serving_threads() - others]

    yield srv, seg, request.param, serving_cpus
    srv.stop()
    seg.unlink()


def _on_cpu(cpu: int, fn):
    """``fn()`` on a thread held on ``cpu`` (so every request it sends leaves from there)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(os.sched_setaffinity, 0, {cpu}).result()
        return pool.submit(fn).result(30)


def test_same_host_knows_a_loopback_peer() -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    with lsock, socket.create_connection(lsock.getsockname()) as c:
        conn, _ = lsock.accept()
        with conn:
            assert affinity.same_host(conn) and affinity.same_host(c)
    assert not affinity.same_host(socket.socket())  # not connected: no peer


@needs_two_cpus
def test_a_stream_request_is_served_on_the_cpu_it_came_from_and_others_anywhere(node) -> None:
    srv, seg, follow, serving_cpus = node
    with socket.create_connection(("127.0.0.1", srv.port)) as s:

        def request(flags: int) -> list[set[int]]:
            table = tcp.RANGE.pack(tcp.segment_key(seg.segment_id), 0, 4096, *tcp.NO_GRANT)
            head = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_READV, flags, 0, 0, 1)
            s.sendall(head + table)
            rep = s.recv(tcp.REP.size, socket.MSG_WAITALL)
            assert tcp.REP.unpack(rep)[:2] == (tcp.REP_MAGIC, tcp.ST_OK)
            assert s.recv(4096, socket.MSG_WAITALL) == bytes(seg.mm[:4096])
            # the reply leaves after the thread was placed: its CPUs are settled now
            return serving_cpus()

        for cpu in (CPUS[-1], CPUS[0], CPUS[-1]):
            held = _on_cpu(cpu, lambda: request(tcp.FLAG_STREAM))
            assert held == ([{cpu}] if follow else [set(CPUS)])
        # A request that is not a stream: the thread gets all its CPUs back.
        assert _on_cpu(CPUS[0], lambda: request(0)) == [set(CPUS)]
        # Flag bits a node does not know are ignored: the read is served as usual.
        assert _on_cpu(CPUS[0], lambda: request(0x8000)) == [set(CPUS)]


@needs_two_cpus
def test_the_client_flags_the_streams_of_a_split_read_and_only_those(node, monkeypatch) -> None:
    """pdserve's client: a read split over PARALLEL_STREAMS connections flags its requests
    (each serving thread then holds one CPU, one of them the caller's), a read that is not
    split does not (its serving thread gets all its CPUs back)."""
    srv, seg, follow, serving_cpus = node
    monkeypatch.setattr(tcp_client, "PARALLEL_MIN_BYTES", 1 << 20)
    endpoint = srv.endpoint(seg, "host")
    replica = kvstore_pb2.Replica(
        node_id="n", segment_id=seg.segment_id, offset=0, size=2 << 20, endpoints=[endpoint]
    )
    client = tcp_client.TcpTransport()
    try:
        buf = bytearray(replica.size)
        assert _on_cpu(CPUS[-1], lambda: client.read_many([(replica, memoryview(buf))])) == [None]
        assert bytes(buf) == bytes(seg.mm[: replica.size])
        held = serving_cpus()
        assert len(held) == tcp.PARALLEL_STREAMS
        if follow:
            assert all(len(c) == 1 for c in held) and {CPUS[-1]} in held
        else:
            assert held == [set(CPUS)] * tcp.PARALLEL_STREAMS
        small = kvstore_pb2.Replica()
        small.CopyFrom(replica)
        small.size = 4096
        out = bytearray(4096)
        assert _on_cpu(CPUS[0], lambda: client.read_many([(small, memoryview(out))])) == [None]
        assert bytes(out) == bytes(seg.mm[:4096])
        assert set(CPUS) in serving_cpus()
    finally:
        client.close()
