"""The master's control wire as a fuzzed surface: hellos, frames, unknown methods and lying
lengths on a raw socket (:class:`Wire`)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from pdserve.store import wire

from .cases import Case
from .invariants import (
    STATUS_CODES,
    TIMEOUT_S,
    Dead,
    Violation,
    check_kv_results,
    check_status,
)
from .store import MASTER_BASES, StoreTarget
from .strategies import (
    corrupt,
    ints,
    raw,
)


def exchange(address: tuple[str, int], data: bytes, *, reset_ok: bool = False) -> bytes:
    """Sends ``data`` and half-closes (from a thread: a peer that answers while we still send
    cannot deadlock us), and returns everything the peer sends until it closes. A reset is a
    violation (it may drop replies) unless ``reset_ok`` (no reply is owed)."""
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:

        def send() -> None:
            with contextlib.suppress(OSError):  # the peer may close first: it says why
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = bytearray()
        try:
            while chunk := sock.recv(1 << 20):
                got += chunk
        except TimeoutError as exc:
            raise Violation(f"neither an answer nor a close within {TIMEOUT_S:g} s") from exc
        except ConnectionResetError as exc:
            if not reset_ok:
                raise Violation(f"connection reset after {len(got)} bytes") from exc
        finally:
            sender.join(TIMEOUT_S)
        return bytes(got)


@st.composite
def mostly(draw, valid: Any, hostile: st.SearchStrategy) -> Any:
    """``valid`` nine times in ten, else a hostile value (shrinks towards valid)."""
    return valid if draw(st.integers(0, 9)) < 9 else draw(hostile)


_WIRE = {name: f"KVMasterService.{name}" for name, _req, _resp in wire.METHODS}


class Wire:
    """The master's control wire: a hello (mostly right), then up to three frames (methods
    with hostile, malformed or valid bodies, unknown ids), the last one possibly lying about
    its length (longer than what follows, or over the limit)."""

    name = "wire"

    def __init__(self, store: StoreTarget) -> None:
        self.address = ("127.0.0.1", store.wire_port)

    @staticmethod
    def frame() -> st.SearchStrategy[tuple[int, bytes, str | None]]:
        def of(name: str) -> st.SearchStrategy[tuple[int, bytes, str | None]]:
            bases = st.integers(0, 3).map(MASTER_BASES[_WIRE[name]])
            mid = wire.METHOD_IDS[name]
            kinds = [
                bases.map(lambda b: (mid, b.SerializeToString(), None)),
                bases.flatmap(raw).map(lambda b: (mid, b, None)),
            ]
            if wire.METHODS[mid - 1][1].DESCRIPTOR.fields:
                kinds.append(
                    bases.flatmap(corrupt).map(lambda mp: (mid, mp[0].SerializeToString(), mp[1]))
                )
            return st.one_of(kinds)

        unknown = st.tuples(
            ints(len(wire.METHODS) + 1, 0xFFFF) | st.just(0), st.binary(max_size=16)
        )
        return st.sampled_from(sorted(_WIRE)).flatmap(of) | unknown.map(lambda t: (*t, None))

    def cases(self) -> st.SearchStrategy[Case]:
        hello = mostly(wire.HELLO, st.binary(max_size=8) | st.just(wire.HELLO[:4] + b"\x02\0\0\0"))
        lie = mostly("", st.sampled_from(["short", "oversize"]))
        frames = st.lists(self.frame(), max_size=3)
        return st.tuples(hello, frames, lie).map(lambda t: Case("wire", t[1], None, t[0::2]))

    def check(self, case: Case) -> None:
        (hello, lie), frames = case.extra, case.data
        data = hello + b"".join(wire.FRAME.pack(len(b), mid, 0) + b for mid, b, _ in frames)
        if lie == "short":
            data += wire.FRAME.pack(100, wire.METHOD_IDS["Stats"], 0) + b"\x00" * 10
        elif lie == "oversize":
            data += wire.FRAME.pack(wire.MAX_BODY + 1, wire.METHOD_IDS["Stats"], 0)
        got = exchange(self.address, data, reset_ok=hello != wire.HELLO)  # closed unread
        if hello != wire.HELLO:
            if got:
                raise Violation(f"wire: {len(got)} bytes answered to a bad hello")
            return
        pos = 0

        def reply() -> tuple[grpc.StatusCode, bytes]:
            nonlocal pos
            if len(got) < pos + wire.FRAME.size:
                raise Violation(f"wire: closed after {pos} bytes, before a reply")
            length, status, _ = wire.FRAME.unpack_from(got, pos)
            body = got[pos + wire.FRAME.size : pos + wire.FRAME.size + length]
            if len(body) != length or status not in STATUS_CODES:
                raise Violation(f"wire: a malformed reply: status {status}, {len(body)}/{length}")
            pos += wire.FRAME.size + length
            return STATUS_CODES[status], body

        for mid, body, path in frames:
            code, answer = reply()
            where = f"wire method {mid}"
            if not 1 <= mid <= len(wire.METHODS):
                if code != grpc.StatusCode.UNIMPLEMENTED or str(mid).encode() not in answer:
                    raise Violation(f"{where}: unknown id answered {code.name}: {answer!r}")
                continue
            name, req_type, resp_type = wire.METHODS[mid - 1]
            try:
                req_type.FromString(body)
            except DecodeError:
                if code != grpc.StatusCode.INVALID_ARGUMENT or b"malformed" not in answer:
                    raise Violation(f"{where}: a malformed body answered {code.name}") from None
                continue
            text = answer.decode("utf-8", "replace") if code != grpc.StatusCode.OK else ""
            check_status(code, text, path, f"wire {name}")
            if code == grpc.StatusCode.OK:
                check_kv_results(resp_type.FromString(answer), path, f"wire {name}")
        if lie == "oversize":
            code, answer = reply()
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED or b"limit" not in answer:
                raise Violation(f"wire: an oversize frame answered {code.name}: {answer!r}")
        if pos != len(got):
            raise Violation(f"wire: {len(got) - pos} bytes more than the replies owed")

    def alive(self) -> None:
        frame = wire.FRAME.pack(0, wire.METHOD_IDS["Stats"], 0)
        try:
            got = exchange(self.address, wire.HELLO + frame)
        except (OSError, Violation) as exc:
            raise Dead(f"wire: a valid Stats call failed: {exc}") from exc
        if len(got) < wire.FRAME.size or wire.FRAME.unpack_from(got)[1] != 0:
            raise Dead(f"wire: a valid Stats call answered {got[:200]!r}")
