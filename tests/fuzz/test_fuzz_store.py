"""Fuzzing the KV store's surfaces on real processes: the master's gRPC services (and the
node's), the master's control wire, the node's tcp data port; plus one fixed case for each
answer the wire and the tcp port define, so that every one is checked in every run."""

from __future__ import annotations

import pytest

from pdserve.bench import fuzz
from pdserve.store import wire
from pdserve.store.transports import tcp
from pdserve.v1 import kvstore_pb2 as pb


def test_master_grpc(store, fuzz_cases: int) -> None:
    assert fuzz.fuzz(fuzz.Master(store), fuzz_cases).cases > 0


def test_control_wire(store, fuzz_cases: int) -> None:
    assert fuzz.fuzz(fuzz.Wire(store), fuzz_cases).cases > 0


def test_tcp_data_port(store, fuzz_cases: int) -> None:
    assert fuzz.fuzz(fuzz.TcpPort(store), fuzz_cases).cases > 0


def _frame(name: str, message) -> tuple[int, bytes, None]:
    return wire.METHOD_IDS[name], message.SerializeToString(), None


@pytest.mark.parametrize(
    ("hello", "frames", "lie"),
    [
        (b"HTTP/1.1", [_frame("Stats", pb.StatsRequest())], ""),  # bad hello: closed, no answer
        (wire.HELLO[:5], [], ""),  # short hello
        (wire.HELLO, [(999, b"", None), (0, b"x", None)], ""),  # unknown methods
        (wire.HELLO, [(wire.METHOD_IDS["LongestPrefix"], b"\xff\xff", None)], ""),  # malformed
        (wire.HELLO, [_frame("BatchExists", pb.BatchKeysRequest())], ""),  # no keys
        (wire.HELLO, [_frame("BatchExists", pb.BatchKeysRequest(keys=["k"] * 5000))], ""),
        (wire.HELLO, [_frame("Stats", pb.StatsRequest())], "short"),  # closed mid-frame
        (wire.HELLO, [_frame("Stats", pb.StatsRequest())], "oversize"),  # over MAX_BODY
    ],
)
def test_control_wire_answers(store, hello, frames, lie) -> None:
    surface = fuzz.Wire(store)
    surface.check(fuzz.Case("wire", frames, None, (hello, lie)))
    surface.alive()


def _req(op: int, seg: int, offset: int, length: int, **kw) -> bytes:
    fields = {"magic": tcp.REQ_MAGIC, "version": tcp.VERSION, "reserved": 0, **kw}
    return tcp.REQ.pack(
        fields["magic"], fields["version"], op, fields["reserved"], seg, offset, length
    )


def test_tcp_data_port_answers(store) -> None:
    """Every reply status, each checked by the protocol model (:func:`fuzz.tcp_expect`)."""
    seg = min(store.segments)
    size = store.segments[seg]
    ranges = tcp.RANGE.pack(seg, 0, 8) + tcp.RANGE.pack(seg, size - 8, 8)
    streams = {
        tcp.ST_OK: _req(tcp.OP_WRITEV, 0, 0, 2)
        + ranges
        + bytes(16)
        + _req(tcp.OP_READV, 0, 0, 2)
        + ranges,
        tcp.ST_BAD_MAGIC: _req(tcp.OP_READ, seg, 0, 1, magic=b"HTTP"),
        tcp.ST_BAD_VERSION: _req(tcp.OP_READ, seg, 0, 1, version=2),
        tcp.ST_BAD_OP: _req(9, seg, 0, 1),
        tcp.ST_UNKNOWN_SEGMENT: _req(tcp.OP_READ, seg ^ 1, 0, 1),
        tcp.ST_OUT_OF_BOUNDS: _req(tcp.OP_WRITE, seg, size - 1, 2**64 - 1) + b"x",
        tcp.ST_SHORT_PAYLOAD: _req(tcp.OP_WRITE, seg, 0, 100) + bytes(10),
        tcp.ST_BAD_COUNT: _req(tcp.OP_READV, 0, 0, tcp.MAX_RANGES + 1),
    }
    surface = fuzz.TcpPort(store)
    for status, stream in streams.items():
        assert fuzz.tcp_expect(stream, store.segments)[-1][0] == status
        surface.check(fuzz.Case("tcp", stream))
        surface.alive()
