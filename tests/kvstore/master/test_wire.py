"""The master's control wire: framing and errors against a wire server over real sockets,
and store clients against real master processes, with the wire on and off."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve import errors, procs
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.services.kvstore.master.state import MasterState
from pdserve.services.kvstore.master.wire import WireServer
from pdserve.store import open_store
from pdserve.store.wire import FRAME, HELLO, MAX_BODY, METHOD_IDS, WireClient, WireUnreachable
from pdserve.v1 import kvstore_pb2 as pb


def _mount(handlers: MasterHandlers, tcp_address: str) -> None:
    """(Re)mounts segment s0 of node n0 with one tcp endpoint."""
    endpoint = pb.Endpoint(transport=pb.TRANSPORT_TCP, address=tcp_address)
    segment = pb.Segment(segment_id="s0", node_id="n0", size=1 << 20, endpoints=[endpoint])
    handlers.MountSegment(pb.MountSegmentRequest(segment=segment, keeps_bytes=True))


@pytest.fixture
def wire() -> Iterator[tuple[MasterHandlers, WireServer]]:
    handlers = MasterHandlers(MasterState(MasterConfig()))
    _mount(handlers, "127.0.0.1:1")
    server = WireServer(handlers, "127.0.0.1", 0)
    yield handlers, server
    server.close()


def _frame(mid: int, body: bytes) -> bytes:
    return FRAME.pack(len(body), mid, 0) + body


def _reply(sock: socket.socket) -> tuple[grpc.StatusCode, bytes]:
    head = b""
    while len(head) < FRAME.size:
        head += sock.recv(FRAME.size - len(head))
    length, status, _ = FRAME.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return next(c for c in grpc.StatusCode if c.value[0] == status), body


def test_wire_calls_answer_like_grpc(wire) -> None:
    handlers, server = wire
    client = WireClient("127.0.0.1", server.port, timeout_s=5)
    start = client.call(
        "BatchPutStart",
        pb.BatchPutStartRequest(client_id="c", items=[pb.PutStartItem(key="k", size=100)]),
    )
    (res,) = start.results
    assert res.code == pb.KV_OK and res.replicas[0].endpoints[0].address == "127.0.0.1:1"
    client.call("BatchPutEnd", pb.BatchKeysRequest(client_id="c", keys=["k"]))
    assert client.call("LongestPrefix", pb.LongestPrefixRequest(keys=["k", "x"])).length == 1
    # A remount with a new endpoint is what the next lookup hands out.
    _mount(handlers, "127.0.0.1:2")
    got = client.call(
        "BatchGetReplicaList", pb.BatchGetReplicaListRequest(client_id="c", keys=["k"])
    )
    assert got.results[0].replicas[0].endpoints[0].address == "127.0.0.1:2"
    # Errors carry the status and message the gRPC servicer would give.
    with pytest.raises(errors.ResourceExhausted, match="max_batch_keys"):
        client.call("BatchExists", pb.BatchKeysRequest(keys=["k"] * 5000))
    # Calls from many threads at once share the pool and the state lock.
    results: list[int] = []

    def ask() -> None:
        for _ in range(50):
            results.append(client.call("LongestPrefix", pb.LongestPrefixRequest(keys=["k"])).length)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1] * 200
    client.close()


def test_wire_calls_are_counted_under_their_grpc_names(wire) -> None:
    """pdserve_grpc_server_calls_total counts the master's wire calls as the same methods'
    gRPC calls, failed ones included (the workers' store calls go over the wire)."""
    from pdserve.telemetry import REGISTRY

    def calls(name: str) -> float:
        labels = {"method": f"/pdserve.v1.KVMasterService/{name}"}
        return REGISTRY.get_sample_value("pdserve_grpc_server_calls_total", labels) or 0.0

    _handlers, server = wire
    before = calls("LongestPrefix"), calls("BatchExists")
    client = WireClient("127.0.0.1", server.port, timeout_s=5)
    for _ in range(3):
        client.call("LongestPrefix", pb.LongestPrefixRequest(keys=["k"]))
    with pytest.raises(errors.ResourceExhausted):
        client.call("BatchExists", pb.BatchKeysRequest(keys=["k"] * 5000))
    client.close()
    assert (calls("LongestPrefix"), calls("BatchExists")) == (before[0] + 3, before[1] + 1)


def test_wire_refuses_bad_frames(wire) -> None:
    _handlers, server = wire
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"HTTP/1.1")  # not our hello: closed, no answer
        assert s.recv(100) == b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(HELLO + _frame(999, b""))
        assert _reply(s) == (grpc.StatusCode.UNIMPLEMENTED, b"unknown method id 999")
        s.sendall(_frame(METHOD_IDS["LongestPrefix"], b"\xff\xff\xff"))
        code, msg = _reply(s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and b"malformed" in msg
        # The connection is still usable after those.
        body = pb.LongestPrefixRequest(keys=["nope"]).SerializeToString()
        s.sendall(_frame(METHOD_IDS["LongestPrefix"], body))
        code, reply = _reply(s)
        assert code == grpc.StatusCode.OK and pb.LongestPrefixResponse.FromString(reply).length == 0
        s.sendall(FRAME.pack(MAX_BODY + 1, METHOD_IDS["Stats"], 0))
        code, msg = _reply(s)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and b"limit" in msg
        assert s.recv(100) == b""  # and closed


def test_wire_client_reports_an_unreachable_master() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(WireUnreachable):
        WireClient("127.0.0.1", port, timeout_s=2).call("Stats", pb.StatsRequest())


@pytest.mark.slow
@pytest.mark.parametrize("wire_port", [0, -1])
def test_store_client_uses_the_wire_when_the_master_has_one(tmp_path: Path, wire_port: int) -> None:
    master = procs.start_master(tmp_path, wire_port=wire_port)
    node = procs.start_node(master.info["grpc"], tmp_path, segment_sizes="16MiB")
    try:
        assert (master.info["wire"] > 0) == (wire_port == 0)
        client = open_store(master.info["grpc"])
        assert client.control_path == ("wire" if wire_port == 0 else "grpc")
        assert client.put("k", b"v" * 1000)
        assert client.get("k") == b"v" * 1000
        with pytest.raises(errors.ResourceExhausted, match="max_batch_keys"):
            client.exists(["k"] * 5000)
        client.close()
        forced = open_store(master.info["grpc"], control="grpc")
        assert forced.control_path == "grpc" and forced.get("k") == b"v" * 1000
        with pytest.raises(errors.ResourceExhausted, match="max_batch_keys"):
            forced.exists(["k"] * 5000)  # the same answer over gRPC
        forced.close()
    finally:
        node.stop()
        procs.remove_shm(node)
        master.stop()


@pytest.mark.slow
def test_store_client_falls_back_to_grpc_when_the_wire_goes_away(cluster) -> None:
    """The wire port stops answering (a master restarted elsewhere, a firewall): the call in
    flight goes over gRPC and the client keeps working."""
    client = open_store(cluster.address)
    assert client.put("fb", b"x" * 10)
    assert client.control_path == "wire"
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    client.master.wire.close()
    client.master.wire = WireClient("127.0.0.1", port, timeout_s=2)
    assert client.get("fb") == b"x" * 10
    assert client.master.wire is None  # dropped; looked up again after WIRE_RETRY_S
    client.close()


@pytest.mark.slow
def test_events_of_wire_calls_reach_watchers(cluster) -> None:
    """Puts and removes over the wire (its own threads) still publish to WatchEvents (the
    event loop's subscribers)."""
    from pdserve import grpcutil
    from pdserve.v1 import kvstore_pb2_grpc

    channel = grpcutil.sync_channel(cluster.address)
    events = kvstore_pb2_grpc.KVMasterServiceStub(channel).WatchEvents(pb.WatchEventsRequest())
    client = open_store(cluster.address)
    try:
        assert client.control_path == "wire"
        time.sleep(0.2)  # let the watch subscribe
        client.put("ev-wire", b"e" * 123)
        client.remove(["ev-wire"])
        got = [next(events), next(events)]
        assert [(e.type, e.key, e.size) for e in got] == [
            (pb.KV_EVENT_STORED, "ev-wire", 123),
            (pb.KV_EVENT_REMOVED, "ev-wire", 123),
        ]
    finally:
        events.cancel()
        client.close()
        channel.close()


def test_wire_client_times_out_on_a_silent_master() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    client = WireClient("127.0.0.1", srv.getsockname()[1], timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded, match=r"no answer within 0\.5 s"):
        client.call("Stats", pb.StatsRequest())
    assert 0.4 < time.monotonic() - start < 3.0
    client.close()
    srv.close()


@pytest.mark.slow
def test_small_gets_are_served_inline_without_touching_a_node(cluster) -> None:
    """An object up to inline_max_bytes travels with its put and comes back with the lookup:
    the node serves no bytes for it; a larger one is read from the node as before."""
    from pdserve import grpcutil
    from pdserve.v1 import kvstore_pb2_grpc

    stubs = [
        kvstore_pb2_grpc.KVNodeServiceStub(grpcutil.sync_channel(f"127.0.0.1:{n.info['port']}"))
        for n in cluster.nodes
    ]

    def served() -> int:  # tcp bytes the nodes sent to readers
        return sum(s.Stats(pb.NodeStatsRequest(), timeout=5).bytes_read for s in stubs)

    client = open_store(cluster.address, transport="tcp")
    small, big = b"s" * 4096, b"b" * 20000
    client.batch_put([("inline-small", small), ("inline-big", big)])
    before = served()
    assert client.get("inline-small") == small
    assert served() == before
    assert client.get("inline-big") == big
    assert served() == before + len(big)
    client.close()
    # A client kept on gRPC (control="grpc") learns the limit from GetControlWire too.
    forced = open_store(cluster.address, transport="tcp", control="grpc")
    forced.put("inline-grpc", b"g" * 100)
    before = served()
    assert forced.get("inline-grpc") == b"g" * 100
    assert served() == before
    forced.close()
