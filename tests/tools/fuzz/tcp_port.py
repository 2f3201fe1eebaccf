"""A storage node's tcp data port, checked against a model of the protocol
(:func:`tcp_expect`), with real data-plane grants and hostile ones (:class:`TcpPort`)."""

from __future__ import annotations

from hypothesis import strategies as st

from pdserve.store.transports import tcp

from .cases import Case
from .control_wire import exchange, mostly
from .invariants import (
    Dead,
    Violation,
)
from .store import StoreTarget, TcpRange
from .strategies import (
    U64,
    ints,
)


def tcp_expect(
    stream: bytes, segments: dict[int, int], grants: dict[int, TcpRange] | None = None
) -> list[tuple[int, int, bool]]:
    """The replies a node owes the request bytes ``stream`` (sent whole, then a half-close):
    ``(status, length, payload follows)`` each; a model of the protocol in
    :mod:`pdserve.store.transports.tcp` written from its spec. ``grants``: the only valid
    grants, per grant op (:attr:`StoreTarget.grants`; unexpired); empty or None = data
    tokens off."""
    from pdserve.store.grants import OP_READ, OP_WRITE

    out: list[tuple[int, int, bool]] = []
    pos = 0
    valid = {(g[0], *g[3:]): op for op, g in (grants or {}).items()}

    def region(op: int, seg: int, offset: int, length: int, *grant) -> int:
        size = segments.get(seg)
        if size is None:
            return tcp.ST_UNKNOWN_SEGMENT
        if length == 0 or offset + length > size:
            return tcp.ST_OUT_OF_BOUNDS
        if valid:
            goff, glen = grant[0], grant[1]
            if valid.get((seg, *grant)) != op or offset < goff or offset + length > goff + glen:
                return tcp.ST_FORBIDDEN
        return tcp.ST_OK

    while len(stream) - pos >= tcp.REQ.size:
        magic, version, op, _res, seg, offset, length = tcp.REQ.unpack_from(stream, pos)
        pos += tcp.REQ.size
        vector = op in (tcp.OP_READV, tcp.OP_WRITEV)
        fail = (
            tcp.ST_BAD_MAGIC
            if magic != tcp.REQ_MAGIC
            else tcp.ST_BAD_VERSION
            if version != tcp.VERSION
            else tcp.ST_BAD_OP
            if op not in (tcp.OP_READ, tcp.OP_WRITE, tcp.OP_READV, tcp.OP_WRITEV)
            else tcp.ST_BAD_COUNT
            if vector and not 1 <= length <= tcp.MAX_RANGES
            else 0
        )
        if fail:
            return [*out, (fail, 0, False)]
        if vector:
            end = pos + length * tcp.RANGE.size
            if end > len(stream):
                return out  # closed within the range table: no answer
            ranges = list(tcp.RANGE.iter_unpack(stream[pos:end]))
        else:
            end = pos + tcp.GRANT.size
            if end > len(stream):
                return out  # closed within the grant: no answer
            ranges = [(seg, offset, length, *tcp.GRANT.unpack(stream[pos:end]))]
        pos = end
        gop = OP_READ if op in (tcp.OP_READ, tcp.OP_READV) else OP_WRITE
        for r in ranges:
            if fail := region(gop, *r):
                return [*out, (fail, 0, False)]
        if op == tcp.OP_WRITEV:
            pos += len(tcp.writev_pad(length))
            if pos > len(stream):
                return out  # closed within the padding: no answer
        total = sum(r[2] for r in ranges)
        if op in (tcp.OP_READ, tcp.OP_READV):
            out.append((tcp.ST_OK, total, True))
        elif len(stream) - pos < total:
            return [*out, (tcp.ST_SHORT_PAYLOAD, 0, False)]
        else:
            pos += total
            out.append((tcp.ST_OK, total, False))
    return out


class TcpPort:
    """A storage node's tcp data port: one to three requests per connection (hostile magic,
    version, op, segment, ranges, counts, grants; payloads exact, short or overlong), then
    trailing bytes, checked reply by reply against :func:`tcp_expect`. Ranges fall mostly
    inside the object of the store's read or write grant (:attr:`StoreTarget.grants`) and
    carry it, else a hostile grant: none, the other op's, made up, or the real one with a
    field changed."""

    name = "tcp"
    #: Most payload bytes one case sends (the node drains 16 MiB after a bad request).
    MAX_PAYLOAD = 4 << 20

    def __init__(self, store: StoreTarget) -> None:
        self.address = store.tcp
        self.segments = store.segments
        self.grants = store.grants

    def _target(self, write: bool) -> TcpRange:
        """The range (and grant) a read or write mostly goes for: a granted object, or with
        data tokens off the first segment, ungranted."""
        from pdserve.store.grants import OP_READ, OP_WRITE

        if self.grants:
            return self.grants[OP_WRITE if write else OP_READ]
        seg = min(self.segments)
        return (seg, 0, self.segments[seg], *tcp.NO_GRANT)

    def cases(self) -> st.SearchStrategy[Case]:
        segs = self.segments
        keys = sorted(segs)

        def hostile_grant(write: bool) -> st.SearchStrategy[tuple]:
            real = self._target(write)[3:]
            made_up = st.tuples(
                ints(0, U64), ints(0, U64), ints(0, U64), ints(0, U64), st.binary(max_size=16)
            )
            changed = st.tuples(st.integers(0, 4), ints(0, U64)).map(
                lambda t: tuple(
                    (v if i != t[0] else (t[1].to_bytes(8, "little") * 2 if i == 4 else t[1]))
                    for i, v in enumerate(real)
                )
            )
            other = st.just(self._target(not write)[3:])
            return st.just(tcp.NO_GRANT) | other | made_up | changed

        @st.composite
        def one_range(draw, write: bool) -> TcpRange:
            target = self._target(write)
            lo, hi = target[1], target[1] + target[2]
            seg = draw(mostly(target[0], st.sampled_from(keys) | ints(0, U64)))
            size = segs.get(seg, 4096)
            offset = draw(st.sampled_from([lo, hi - 1]) | st.integers(lo, hi - 1))
            offset = draw(mostly(offset, st.sampled_from([size, size + 1, 2**63, U64])))
            room = max(hi - offset, 0)
            length = draw(st.integers(1, max(1, min(room, 1 << 16))))
            length = draw(mostly(length, st.sampled_from([0, room, room + 1, U64])))
            grant = draw(mostly(target[3:], hostile_grant(write)))
            return (seg, offset, length, *grant)

        @st.composite
        def request(draw) -> bytes:
            op = draw(mostly(draw(st.sampled_from([1, 2, 3, 4])), ints(0, 255)))
            write = op in (tcp.OP_WRITE, tcp.OP_WRITEV)
            magic = draw(mostly(tcp.REQ_MAGIC, st.binary(min_size=4, max_size=4)))
            version = draw(mostly(tcp.VERSION, ints(0, 255)))
            reserved = draw(mostly(0, ints(0, 0xFFFF)))
            if op in (tcp.OP_READV, tcp.OP_WRITEV):
                many = draw(mostly(0, st.sampled_from([tcp.MAX_RANGES, tcp.MAX_RANGES + 1])))
                if many:  # the most ranges a request may have, or one more
                    target = self._target(write)
                    ranges = [(target[0], target[1], 1, *target[3:])] * many
                else:
                    ranges = draw(st.lists(one_range(write), min_size=1, max_size=6))
                count = draw(mostly(len(ranges), st.sampled_from([0, len(ranges) + 1, U64])))
                head = tcp.REQ.pack(magic, version, op, reserved, 0, 0, count)
                head += b"".join(tcp.RANGE.pack(*r) for r in ranges)
                if write:
                    head += draw(mostly(tcp.writev_pad(count), st.binary(max_size=64)))
            else:
                ranges = [draw(one_range(write))]
                head = tcp.REQ.pack(magic, version, op, reserved, *ranges[0][:3])
                head += tcp.GRANT.pack(*ranges[0][3:])
            need = sum(r[2] for r in ranges) if write else 0
            need = need if need <= self.MAX_PAYLOAD // 3 else 64
            sent = draw(mostly(need, st.integers(0, need + 64)))
            return head + bytes(sent)

        tail = mostly(b"", st.binary(max_size=40))
        return st.tuples(st.lists(request(), min_size=1, max_size=3), tail).map(
            lambda t: Case("tcp", b"".join(t[0]) + t[1])
        )

    def check(self, case: Case) -> None:
        got = exchange(self.address, case.data)
        pos = 0
        want = tcp_expect(case.data, self.segments, self.grants)
        for i, (status, length, payload) in enumerate(want):
            if len(got) < pos + tcp.REP.size:
                raise Violation(f"tcp: reply {i} (status {status}) missing; got {got[pos:]!r}")
            magic, got_status, got_length = tcp.REP.unpack_from(got, pos)
            if (magic, got_status, got_length) != (tcp.REP_MAGIC, status, length):
                raise Violation(
                    f"tcp: reply {i} is {magic!r} status {got_status} length {got_length}; "
                    f"want status {status} length {length}"
                )
            pos += tcp.REP.size + (length if payload else 0)
        if pos != len(got):
            raise Violation(f"tcp: {len(got) - pos} bytes more than the replies owed")

    def alive(self) -> None:
        seg, offset, _size, *grant = self._target(write=False)
        head = tcp.REQ.pack(tcp.REQ_MAGIC, tcp.VERSION, tcp.OP_READ, 0, seg, offset, 1)
        try:
            got = exchange(self.address, head + tcp.GRANT.pack(*grant))
        except (OSError, Violation) as exc:
            raise Dead(f"tcp: a valid 1-byte READ failed: {exc}") from exc
        if (
            got[: tcp.REP.size] != tcp.REP.pack(tcp.REP_MAGIC, tcp.ST_OK, 1)
            or len(got) != tcp.REP.size + 1
        ):
            raise Dead(f"tcp: a valid 1-byte READ answered {got!r}")
