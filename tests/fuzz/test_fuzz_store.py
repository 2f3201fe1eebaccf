"""Fuzzing the KV store's surfaces on real processes: the master's gRPC services (and the
node's), the master's control wire, the node's tcp data port; plus one fixed case for each
answer the wire and the tcp port define, so that every one is checked in every run."""

from __future__ import annotations

import pytest
from tools.fuzz.cases import Case
from tools.fuzz.control_wire import Wire
from tools.fuzz.runner import fuzz
from tools.fuzz.store import Master
from tools.fuzz.tcp_port import TcpPort, tcp_expect

from pdserve.store import wire
from pdserve.store.transports import tcp
from pdserve.v1 import kvstore_pb2 as pb


@pytest.mark.slow
def test_master_grpc(store, fuzz_cases: int) -> None:
    assert fuzz(Master(store), fuzz_cases).cases > 0


@pytest.mark.slow
def test_control_wire(store, fuzz_cases: int) -> None:
    assert fuzz(Wire(store), fuzz_cases).cases > 0


@pytest.mark.slow
def test_tcp_data_port(store, fuzz_cases: int) -> None:
    assert fuzz(TcpPort(store), fuzz_cases).cases > 0


def _frame(name: str, message) -> tuple[int, bytes, None]:
    return wire.METHOD_IDS[name], message.SerializeToString(), None


@pytest.mark.slow
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
    surface = Wire(store)
    surface.check(Case("wire", frames, None, (hello, lie)))
    surface.alive()


def _req(op: int, rng: tuple, **kw) -> bytes:
    """A READ or WRITE header for ``rng`` (segment key, offset, length, grant...), then its
    grant."""
    fields = {"magic": tcp.REQ_MAGIC, "version": tcp.VERSION, "reserved": 0, **kw}
    head = tcp.REQ.pack(fields["magic"], fields["version"], op, fields["reserved"], *rng[:3])
    return head + tcp.GRANT.pack(*rng[3:])


def _vec(op: int, ranges: list[tuple], count: int | None = None) -> bytes:
    n = len(ranges) if count is None else count
    head = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, op, 0, 0, 0, n)
    pad = tcp.writev_pad(n) if op == tcp.OP_WRITEV else b""
    return head + b"".join(tcp.RANGE.pack(*r) for r in ranges) + pad


@pytest.mark.slow
def test_tcp_data_port_answers(store) -> None:
    """Every reply status, each checked by the protocol model (:func:`tcp_expect`);
    ST_EXPIRED, which needs a grant that ran out, is checked in tests/store/test_data_tokens.py."""
    surface = TcpPort(store)
    seg, off, size, *grant = surface._target(write=False)
    wseg, woff, wsize, *wgrant = surface._target(write=True)
    assert store.grants, "the fuzz store runs with data tokens on"
    seg_size = store.segments[seg]
    reads = [(seg, off, 8, *grant), (seg, off + size - 8, 8, *grant)]
    writes = [(wseg, woff, 8, *wgrant), (wseg, woff + wsize - 8, 8, *wgrant)]
    streams = {
        tcp.ST_OK: _vec(tcp.OP_WRITEV, writes) + bytes(16) + _vec(tcp.OP_READV, reads),
        tcp.ST_BAD_MAGIC: _req(tcp.OP_READ, reads[0], magic=b"HTTP"),
        tcp.ST_BAD_VERSION: _req(tcp.OP_READ, reads[0], version=1),
        tcp.ST_BAD_OP: _req(9, reads[0]),
        tcp.ST_UNKNOWN_SEGMENT: _req(tcp.OP_READ, (seg ^ 1, *reads[0][1:])),
        tcp.ST_OUT_OF_BOUNDS: _req(tcp.OP_WRITE, (seg, seg_size - 1, 2**64 - 1, *wgrant)) + b"x",
        tcp.ST_SHORT_PAYLOAD: _req(tcp.OP_WRITE, (wseg, woff, 100, *wgrant)) + bytes(10),
        tcp.ST_BAD_COUNT: _vec(tcp.OP_READV, [], count=tcp.MAX_RANGES + 1),
        tcp.ST_FORBIDDEN: _vec(tcp.OP_WRITEV, reads[:1]) + bytes(8),  # a read grant, a write
    }
    for status, stream in streams.items():
        assert tcp_expect(stream, store.segments, store.grants)[-1][0] == status
        surface.check(Case("tcp", stream))
        surface.alive()
