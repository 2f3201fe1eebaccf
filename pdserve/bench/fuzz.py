"""Fuzzing every public surface with hypothesis: the strategies, the invariants each answer
must keep, and ``pdserve bench fuzz`` (:func:`run`). The tests (tests/fuzz) run a few dozen
cases per surface against in-process or real servers; the bench runs thousands against real
processes.

Surfaces:

* ``router-http``: the OpenAI routes (JSON bodies with one hostile field, hostile JSON, raw
  garbage, hostile ``x-request-id``), /v1/models, /health, /metrics and unknown routes;
* ``router-grpc``: RouterService and grpc.health;
* ``engine``: PrefillService and DecodeService of real torch workers on the tiny model;
* ``master``: KVMasterService (incl. WatchEvents), KVNodeService and grpc.health;
* ``wire``: the master's control wire (hellos, frames, unknown methods, lying lengths);
* ``tcp``: a storage node's tcp data port, checked against a model of the protocol
  (:func:`tcp_expect`), with real data-plane grants the master handed out and hostile ones;
* ``meta``: MetaService and the Mooncake /metadata HTTP endpoint.

gRPC requests are: a valid request with one field (nested too) set to a hostile value of its
type, requests with hostile values everywhere, or raw bytes (garbage, spliced or truncated
encodings, invalid UTF-8, deep nesting) sent through a generic channel call.

Invariants, per case: the server still answers a valid request afterwards (no crash, no hang:
every call has a deadline); gRPC never answers UNKNOWN, INTERNAL, DATA_LOSS or UNAVAILABLE and
HTTP never 5xx; every error carries a message, and when the case set one field of a valid request to a
hostile value, an INVALID_ARGUMENT / OUT_OF_RANGE (HTTP 400, a per-item KV_INVALID) message
names that field.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import re
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import message_factory, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdserve import grpcutil
from pdserve.bench.cli import FUZZ_SURFACES
from pdserve.store import wire
from pdserve.store.transports import tcp
from pdserve.v1 import common_pb2, engine_pb2, kvstore_pb2, kvstore_pb2_grpc, meta_pb2, router_pb2

SURFACES = tuple(FUZZ_SURFACES.split(","))
#: Seconds any single answer may take before the case counts as a hang.
TIMEOUT_S = 30.0
#: Seconds an endless stream (a watch) is read before the client cancels it.
ENDLESS_S = 0.3

#: Statuses no input may provoke: a bug (UNKNOWN, INTERNAL), lost data, or UNAVAILABLE (the
#: 503 of gRPC: every server a fuzz run talks to is up, so a request that gets it broke one).
FORBIDDEN = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNAVAILABLE,
    }
)
#: Statuses that blame the input: they must name the field the case corrupted.
BLAMING = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Violation(AssertionError):
    """A case broke one of the invariants."""


class Dead(Violation):
    """The server stopped answering valid requests: later cases would only repeat it."""


# --- invariants -----------------------------------------------------------------------------


def names(message: str, path: str) -> bool:
    """Whether ``message`` names the field at ``path``: its own name (``"items[0].key"`` ->
    ``key``; a plural also by its singular: ``keys`` by "key is empty") or its top-level
    field's (``messages[0].content`` by "messages has 9000 characters")."""
    parts = re.sub(r"\[\d+\]", "", path).lower().split(".")
    text = message.lower()
    leaf = parts[-1]
    return any(n in text for n in (leaf, parts[0])) or (leaf.endswith("s") and leaf[:-1] in text)


def check_status(
    code: grpc.StatusCode,
    details: str,
    path: str | None,
    where: str,
    *,
    endless: bool = False,
) -> None:
    """The invariants of one gRPC (or control wire) answer."""
    if code in FORBIDDEN:
        raise Violation(f"{where}: {code.name}: {details}")
    if "metadata size exceeds" in details:  # gRPC dropped the status: its message was too long
        raise Violation(f"{where}: the server's status was lost: {code.name}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not endless:
        raise Violation(f"{where}: no answer within {TIMEOUT_S:g} s")
    if code != grpc.StatusCode.OK and not details.strip():
        raise Violation(f"{where}: {code.name} without a message")
    if path and code in BLAMING and not names(details, path):
        raise Violation(f"{where}: {code.name} does not name {path!r}: {details}")


def check_http(status: int, body: bytes, path: str | None, where: str) -> str:
    """The invariants of one HTTP answer (``where`` = "METHOD /path"; a HEAD answer has no
    body to check); returns its body as text."""
    text = body.decode("utf-8", "replace")
    if status >= 500:
        raise Violation(f"{where}: HTTP {status}: {text[:500]}")
    if where.startswith("HEAD "):
        return text
    if status >= 400 and not text.strip():
        raise Violation(f"{where}: HTTP {status} without a message")
    if path and status == 400 and not names(text, path):
        raise Violation(f"{where}: HTTP 400 does not name {path!r}: {text[:500]}")
    return text


def check_kv_results(resp: Message, path: str | None, where: str) -> None:
    """Per-item outcomes of a KV master answer: every failed item says why, and a KV_INVALID
    item names the field the case corrupted (in that item, or ``keys``)."""
    for i, r in enumerate(getattr(resp, "results", ())):
        if r.code == kvstore_pb2.KV_OK or "message" not in r.DESCRIPTOR.fields_by_name:
            continue
        name = kvstore_pb2.KVErrorCode.Name(r.code)
        if not r.message:
            raise Violation(f"{where}: results[{i}] is {name} without a message")
        blamed = path == "keys" or (path or "").startswith(f"items[{i}].")
        if r.code == kvstore_pb2.KV_INVALID and blamed and not names(r.message, path or ""):
            raise Violation(f"{where}: results[{i}] {name} does not name {path!r}: {r.message}")


# --- cases ----------------------------------------------------------------------------------


def _short(value: Any, limit: int = 400) -> str:
    if isinstance(value, Message):
        value = text_format.MessageToString(value, as_one_line=True)
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...<{len(text)} chars>"


@dataclass
class Case:
    """One input: ``op`` (a gRPC method, ``"METHOD /path"``, or the wire / tcp stream),
    ``data`` (a message, bytes, ...), ``path`` of the one field set to a hostile value on
    purpose (None: several fields, or raw bytes), and ``extra`` (gRPC metadata, HTTP
    headers)."""

    op: str
    data: Any
    path: str | None = None
    extra: Any = ()

    def __repr__(self) -> str:
        head = f"Case({self.op!r}"
        if self.path:
            head += f", {self.path}={_short(_at(self.data, self.path), 200)}"
        return f"{head}, data={_short(self.data)}, extra={_short(self.extra)})"


def _at(data: Any, path: str) -> Any:
    """The value at ``path`` ("a[0].b") in a message or a JSON body; None if absent."""
    try:
        for part in path.split("."):
            name, _, index = part.partition("[")
            data = data.get(name) if isinstance(data, dict) else getattr(data, name)
            if index:
                data = data[int(index[:-1])]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return data


class Surface(Protocol):
    name: str

    def cases(self) -> st.SearchStrategy[Case]: ...
    def check(self, case: Case) -> None: ...
    def alive(self) -> None: ...


# --- hostile values -------------------------------------------------------------------------

U32, U64, I32 = 2**32 - 1, 2**64 - 1, 2**31
FLOAT_EDGES = [math.nan, math.inf, -math.inf, -0.0, -1.0, 0.5, 1.5, 1e-45, 3.4e38]
_INT_EDGES = (0, 1, -1, 63, 64, 4096, 4097, I32 - 1, I32, U32, 2**53 + 1, 2**63, U64, 2**64)
_TEXT_EDGES = [
    "",
    " ",
    "\x00",
    "a" * 129,
    "b" * 257,
    "\u202e\ufeff\u200b",
    "\U0001f600" * 70,
    "../..",
    "%s%n{0}",
    "k\r\nk",
    "\uff21\uff22",  # fullwidth AB
]
_BIG_TEXT = ["c" * 4097, "x" * (1 << 20)]


def pick(values: list) -> st.SearchStrategy[Any]:
    """``sampled_from(values)`` drawn by index, so that hypothesis never builds the repr of
    megabyte-sized values."""
    return st.integers(0, len(values) - 1).map(values.__getitem__)


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi], edges first."""
    edges = sorted({v for v in (lo, hi, *_INT_EDGES) if lo <= v <= hi})
    return st.sampled_from(edges) | st.integers(lo, hi)


def texts(small: bool = False) -> st.SearchStrategy[str]:
    """Hostile strings: empty, NUL, over common limits, bidi controls, emoji; up to 1 MiB
    unless ``small``."""
    return pick(_TEXT_EDGES + ([] if small else _BIG_TEXT)) | st.text(max_size=40)


def blobs(small: bool = False) -> st.SearchStrategy[bytes]:
    edges = [b"", b"\xff" * 16, bytes(17)] + ([] if small else [bytes(1 << 16)])
    return pick(edges) | st.binary(max_size=64)


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-I32, I32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, U32),
    FieldDescriptor.TYPE_UINT64: (0, U64),
}


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def scalar(f: FieldDescriptor, small: bool = False) -> st.SearchStrategy[Any]:
    """Hostile values of a scalar field's type (unknown enum numbers, NaN, extremes...)."""
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return texts(small)
    if t == FieldDescriptor.TYPE_BYTES:
        return blobs(small)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return st.sampled_from(sorted({*known, -1, 99, I32 - 1, -I32}))
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == FieldDescriptor.TYPE_FLOAT else 64
        return st.sampled_from(FLOAT_EDGES) | st.floats(width=width)
    return ints(*_INT_RANGES[t])


def value(f: FieldDescriptor, small: bool = False, depth: int = 3) -> st.SearchStrategy[Any]:
    """Hostile values for field ``f``: repeated fields get a few hostile items or thousands of
    small ones, maps too many or bad entries, messages unset or hostile throughout."""
    if _is_map(f):
        k, v = (f.message_type.fields_by_name[n] for n in ("key", "value"))
        text_key = k.type == FieldDescriptor.TYPE_STRING
        filler = {
            FieldDescriptor.TYPE_STRING: "v",
            FieldDescriptor.TYPE_BOOL: False,
            FieldDescriptor.TYPE_FLOAT: 0.0,
            FieldDescriptor.TYPE_DOUBLE: 0.0,
        }.get(v.type, 0)
        many = st.sampled_from([65, 1000]).map(
            lambda n: {(f"k{i}" if text_key else i): filler for i in range(n)}
        )
        return st.dictionaries(scalar(k, True), scalar(v, True), max_size=3) | many
    if f.message_type is not None:
        one = message(f.message_type, small, depth - 1)
    else:
        one = scalar(f, small)
    if not f.is_repeated:
        return st.none() | one if f.message_type is not None else one
    small_one = message(f.message_type, True, 1) if f.message_type is not None else scalar(f, True)
    many = st.tuples(small_one, st.sampled_from([64, 4096, 4097, 10_000]))
    return st.lists(one, max_size=3) | many.map(lambda t: [t[0]] * t[1])


def _assign(msg: Message, f: FieldDescriptor, v: Any) -> None:
    if f.is_repeated:
        msg.ClearField(f.name)
        if _is_map(f):
            getattr(msg, f.name).update(v)
        else:
            getattr(msg, f.name).extend(v)
    elif f.message_type is not None:
        msg.ClearField(f.name)
        if v is not None:
            getattr(msg, f.name).CopyFrom(v)
    else:
        setattr(msg, f.name, v)


def message(desc: Descriptor, small: bool = False, depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of type ``desc`` with hostile values in any subset of their fields."""
    cls = message_factory.GetMessageClass(desc)
    if depth <= 0:
        return st.just(cls())

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, v in values.items():
            _assign(msg, desc.fields_by_name[name], v)
        return msg

    fields = {f.name: value(f, small, depth) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields).map(build)


def field_paths(
    msg: Message, prefix: str = "", depth: int = 3
) -> list[tuple[str, FieldDescriptor]]:
    """Every field of ``msg`` and of the submessages it sets (first item of repeated ones)."""
    out = []
    for f in msg.DESCRIPTOR.fields:
        path = prefix + f.name
        out.append((path, f))
        if f.message_type is None or _is_map(f) or depth <= 1:
            continue
        if f.is_repeated and len(getattr(msg, f.name)):
            out += field_paths(getattr(msg, f.name)[0], f"{path}[0].", depth - 1)
        elif not f.is_repeated and msg.HasField(f.name):
            out += field_paths(getattr(msg, f.name), f"{path}.", depth - 1)
    return out


def corrupt(base: Message) -> st.SearchStrategy[tuple[Message, str | None]]:
    """``base`` with one field (by path, nested too) set to a hostile value: (message, path);
    the path is None where the field is a message (hostile in many fields at once)."""

    def apply(path: str, f: FieldDescriptor, v: Any) -> tuple[Message, str | None]:
        msg = type(base)()
        msg.CopyFrom(base)
        parent = msg
        for part in path.split(".")[:-1]:
            name, _, index = part.partition("[")
            parent = getattr(parent, name)
            if index:
                parent = parent[int(index[:-1])]
        _assign(parent, f, v)
        return msg, None if f.message_type is not None and not _is_map(f) else path

    return st.sampled_from(field_paths(base)).flatmap(
        lambda pf: value(pf[1]).map(lambda v: apply(pf[0], pf[1], v))
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def raw(base: Message) -> st.SearchStrategy[bytes]:
    """Malformed encodings near ``base``: garbage, spliced or truncated bytes, a length past the
    end, invalid UTF-8 in each string field, groups nested beyond any recursion limit."""
    good = base.SerializeToString()
    edges = [
        b"\xff",
        b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length 4 GiB
        b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
        b"\x0b" * 2000 + b"\x0c" * 2000,  # 2000 nested groups
        b"\x07",  # wire type 7
        good[:-1] if good else b"\x0a",
    ]
    edges += [
        _varint(f.number << 3 | 2) + b"\x02\xc3\x28"
        for f in base.DESCRIPTOR.fields
        if f.type == FieldDescriptor.TYPE_STRING
    ]
    splice = st.tuples(st.integers(0, len(good)), st.integers(0, 8), st.binary(max_size=8)).map(
        lambda t: good[: t[0]] + t[2] + good[t[0] + t[1] :]
    )
    return pick(edges) | st.binary(max_size=128) | splice


# --- gRPC -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    response: type[Message]
    stream: bool


def service_methods(desc: ServiceDescriptor) -> dict[str, Method]:
    """``"Service.Method"`` -> :class:`Method` for each method of a service."""
    return {
        f"{desc.name}.{m.name}": Method(
            f"/{desc.full_name}/{m.name}",
            message_factory.GetMessageClass(m.input_type),
            message_factory.GetMessageClass(m.output_type),
            m.server_streaming,
        )
        for m in desc.methods
    }


HEALTH = service_methods(health_pb2.DESCRIPTOR.services_by_name["Health"])


def grpc_call(
    channel: grpc.Channel,
    m: Method,
    data: bytes,
    metadata: Iterable = (),
    timeout: float = TIMEOUT_S,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Calls ``m`` with raw request bytes; (status, details, raw responses)."""
    out: list[bytes] = []
    try:
        if m.stream:
            call = channel.unary_stream(m.path)(data, timeout=timeout, metadata=tuple(metadata))
            out.extend(call)
        else:
            out.append(channel.unary_unary(m.path)(data, timeout=timeout, metadata=tuple(metadata)))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", out
    return grpc.StatusCode.OK, "", out


#: A base request per method: a function of a small int (to vary keys and ids across cases).
Bases = dict[str, Callable[[int], Message]]


class GrpcSurface:
    """Fuzzes gRPC methods: per case one method, with its valid base request, one field of
    it made hostile, a request hostile throughout, or raw bytes. ``routes`` maps
    ``"Service.Method"`` to its channel and :class:`Method`, ``bases`` gives each fuzzed
    method's valid requests, and ``probe`` is the method whose valid call proves the
    server alive."""

    name = ""
    #: Streams that never end by themselves (watches): read for ENDLESS_S, then cancelled.
    endless: frozenset[str] = frozenset()
    #: Methods served by grpc's own library, whose errors carry no message (grpc.health
    #: answers an unknown service with a bare NOT_FOUND): still fuzzed for the rest.
    bare = frozenset({"Health.Check"})

    def __init__(
        self, routes: dict[str, tuple[grpc.Channel, Method]], bases: Bases, probe: str
    ) -> None:
        self.routes = routes
        self.bases = bases
        self.probe = probe

    @staticmethod
    def route(
        address: str, services: Iterable[ServiceDescriptor]
    ) -> dict[str, tuple[grpc.Channel, Method]]:
        """Routes to every method of ``services`` (and grpc.health) at ``address``."""
        channel = grpcutil.sync_channel(address)
        methods = dict(HEALTH)
        for s in services:
            methods.update(service_methods(s))
        return {name: (channel, m) for name, m in methods.items() if name != "Health.Watch"}

    def cases(self) -> st.SearchStrategy[Case]:
        def of(name: str) -> st.SearchStrategy[Case]:
            m = self.routes[name][1]
            bases = st.integers(0, 3).map(self.bases[name])
            kinds = [
                bases.map(lambda b: Case(name, b)),
                message(m.request.DESCRIPTOR).map(lambda b: Case(name, b)),
                bases.flatmap(raw).map(lambda b: Case(name, b)),
            ]
            if m.request.DESCRIPTOR.fields:
                kinds.append(bases.flatmap(corrupt).map(lambda mp: Case(name, *mp)))
            return st.one_of(kinds)

        return st.sampled_from(sorted(self.bases)).flatmap(of)

    def call(self, case: Case) -> list[bytes]:
        channel, m = self.routes[case.op]
        data = case.data if isinstance(case.data, bytes) else case.data.SerializeToString()
        endless = case.op in self.endless
        code, details, out = grpc_call(
            channel, m, data, case.extra, ENDLESS_S if endless else TIMEOUT_S
        )
        if case.op in self.bare and code not in FORBIDDEN:
            return out
        check_status(code, details, case.path, case.op, endless=endless)
        return out

    def check(self, case: Case) -> None:
        m = self.routes[case.op][1]
        for reply in self.call(case):
            self.check_reply(case, m.response.FromString(reply))

    def check_reply(self, case: Case, resp: Message) -> None:
        pass

    def alive(self) -> None:
        channel, m = self.routes[self.probe]
        data = self.bases[self.probe](0).SerializeToString()
        code, details, _ = grpc_call(channel, m, data, timeout=TIMEOUT_S)
        if code != grpc.StatusCode.OK:
            raise Dead(f"{self.name}: a valid {self.probe} now answers {code.name}: {details}")


# --- HTTP -----------------------------------------------------------------------------------


def http_call(
    address: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, bytes]:
    """One request on a fresh connection to ``address`` (host:port); (status, body)."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError as exc:
        raise Violation(f"{method} {path}: no answer within {TIMEOUT_S:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise Violation(f"{method} {path}: the connection failed: {exc!r}") from exc
    finally:
        conn.close()


def _json_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        ints(-(2**64), 2**64) | st.sampled_from([10**400, -(10**400)]),
        st.sampled_from(FLOAT_EDGES) | st.floats(),
        texts(small=True),
    )


#: Any JSON value, hostile throughout (NaN, 400-digit numbers, odd strings, nesting).
JSON = st.recursive(
    _json_leaf(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts(True), kids, max_size=4),
    max_leaves=10,
)
#: Bodies no JSON parser should choke on: nesting past any recursion limit, numbers past
#: Python's int-conversion limit, lone surrogates, bad UTF-8, a body over the size limit.
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"\xff\xfe\x00",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"1" * 5000,
    b'{"model": "M", "prompt": "\\ud800"}',
    b'{"model": "M", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b"x" * (5 << 20),
]
_DROP = object()
_REQUEST_ID = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=160)


def corrupt_json(base: dict, keys: Iterable[str]) -> st.SearchStrategy[tuple[dict, str]]:
    """``base`` with one of ``keys`` (``"a[0].b"`` reaches into lists) set to hostile JSON or
    removed: (body, path)."""

    def apply(path: str, v: Any) -> tuple[dict, str]:
        body = json.loads(json.dumps(base))
        parent: Any = body
        *steps, last = path.split(".")
        for part in steps:
            name, _, index = part.partition("[")
            parent = parent[name][int(index[:-1])] if index else parent[name]
        if v is _DROP:
            parent.pop(last, None)
        else:
            parent[last] = v
        return body, path

    return st.sampled_from(sorted(keys)).flatmap(
        lambda k: (JSON | st.just(_DROP)).map(lambda v: apply(k, v))
    )


class RouterHttp:
    """The router's OpenAI HTTP API."""

    name = "router-http"
    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, address: str, model: str) -> None:
        from pdserve.services.router.frontend import UNSUPPORTED_OPENAI

        self.address = address
        self.model = model
        common = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p"}
        common |= {"top_k", "seed", "stop", "stream", "stream_options", "n", "ignore_eos"}
        common |= {"request_id", "cache_salt", "unknown_field", *UNSUPPORTED_OPENAI}
        common |= {"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"}
        common |= {"repetition_penalty", "logit_bias", "stop_token_ids", "echo"}
        common |= {"response_format"}
        prompt = {"model": model, "prompt": "hello fuzz", "max_tokens": 2}
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        self.bodies = {
            "/v1/completions": ([prompt, {**prompt, "prompt": [1, 2, 3], "stream": True}], common),
            "/v1/chat/completions": (
                [chat, {**chat, "stream": True}],
                common | {"messages", "messages[0].role", "messages[0].content"},
            ),
        }

    def cases(self) -> st.SearchStrategy[Case]:
        json_head = {"content-type": "application/json"}
        corrupted = [
            st.sampled_from(bases)
            .flatmap(lambda b, keys=keys: corrupt_json(b, keys))
            .map(lambda bp, r=route: Case(f"POST {r}", bp[0], bp[1], json_head))
            for route, (bases, keys) in self.bodies.items()
        ]
        posts = st.sampled_from(sorted(self.bodies))
        hostile = st.tuples(posts, JSON).map(lambda t: Case(f"POST {t[0]}", t[1], None, json_head))
        garbage = st.tuples(posts, pick(RAW_BODIES) | st.binary(max_size=64)).map(
            lambda t: Case(f"POST {t[0]}", t[1].replace(b'"M"', json.dumps(self.model).encode()))
        )
        header = st.tuples(posts, _REQUEST_ID).map(
            lambda t: Case(
                f"POST {t[0]}",
                self.bodies[t[0]][0][0],
                "request_id",
                {**json_head, "x-request-id": t[1]},
            )
        )
        path = st.sampled_from(self.ROUTES) | st.text(
            st.characters(codec="ascii", categories=["L", "N", "P"]), max_size=20
        ).map(lambda p: "/" + urllib.parse.quote(p))
        other = st.tuples(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
            path,
            st.binary(max_size=32),
        ).map(lambda t: Case(f"{t[0]} {t[1]}", t[2]))
        return st.one_of(*corrupted, hostile, garbage, header, other)

    def check(self, case: Case) -> None:
        method, path = case.op.split(" ", 1)
        body = case.data if isinstance(case.data, bytes) else json.dumps(case.data).encode()
        status, reply = http_call(self.address, method, path, body, dict(case.extra or {}))
        text = check_http(status, reply, case.path, case.op)
        if status >= 400 and method != "HEAD":
            try:
                error = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError) as exc:
                raise Violation(f"{case.op}: HTTP {status} not in the OpenAI error shape") from exc
            if not isinstance(error.get("message"), str) or not error["message"]:
                raise Violation(f"{case.op}: HTTP {status} error without a message: {text}")
        if status == 200 and 'data: {"error"' in text:  # an SSE stream that failed midway
            raise Violation(f"{case.op}: an error in the stream: {text[:500]}")

    def alive(self) -> None:
        body = json.dumps(self.bodies["/v1/completions"][0][0]).encode()
        status, reply = http_call(self.address, "POST", "/v1/completions", body)
        if status != 200:
            raise Dead(f"router-http: a valid completion now answers {status}: {reply[:300]!r}")


def _generate_base(model: str) -> Callable[[int], Message]:
    sampling = common_pb2.SamplingParams(max_tokens=2)
    variants = [
        router_pb2.GenerateRequest(model=model, prompt="hello fuzz", sampling=sampling),
        router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling),
        router_pb2.GenerateRequest(
            messages=[router_pb2.ChatMessage(role=router_pb2.CHAT_ROLE_USER, content="hi")],
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9),
        ),
        router_pb2.GenerateRequest(
            prompt="write", sampling=sampling, mode=router_pb2.DISAGG_MODE_WRITE
        ),
    ]
    return lambda k: variants[k % len(variants)]


class RouterGrpc(GrpcSurface):
    """RouterService; a case may carry a hostile ``x-request-id``."""

    name = "router-grpc"

    def __init__(self, address: str, model: str) -> None:
        services = [router_pb2.DESCRIPTOR.services_by_name["RouterService"]]
        generate = _generate_base(model)
        bases: Bases = {
            "RouterService.Generate": generate,
            "RouterService.GenerateStream": generate,
            "RouterService.Tokenize": lambda k: router_pb2.TokenizeRequest(
                model=model, text="hello fuzz", add_special_tokens=k % 2 == 0
            ),
            "RouterService.ListModels": lambda k: router_pb2.ListModelsRequest(),
            "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
        }
        super().__init__(self.route(address, services), bases, "RouterService.Generate")

    def cases(self) -> st.SearchStrategy[Case]:
        """Also: a valid Generate(Stream) whose ``x-request-id`` metadata is hostile."""
        ids = st.tuples(
            st.sampled_from(["RouterService.Generate", "RouterService.GenerateStream"]),
            st.integers(0, 3),
            _REQUEST_ID,
        ).map(lambda t: Case(t[0], self.bases[t[0]](t[1]), "request_id", (("x-request-id", t[2]),)))
        return super().cases() | ids


# --- model workers --------------------------------------------------------------------------

#: Flags of the fuzzed workers: the tiny model, and max_tokens capped so that a valid case
#: generates a few tokens, not thousands.
WORKER_FLAGS = {
    "engine": "torch",
    "served_model_name": "tiny",
    "chunk_size": 16,
    "max_model_len": 512,
    "max_tokens_limit": 16,
    "port": 0,
    "metrics_port": -1,
}


def start_workers(log_dir: Path, master: str) -> list[Any]:
    """A torch prefill and a torch decode worker on the tiny model with the KV store at
    ``master``, started at once; READY (procs.ServiceProcess), the caller stops them."""
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import service_args, spawn_service, wait_ready

    model = build_tiny_model()
    started = [
        spawn_service(
            f"fuzz-{role}",
            service_args(role, model=model, store_master=master, **WORKER_FLAGS),
            log_dir,
        )
        for role in ("prefill", "decode")
    ]
    try:
        for proc in started:
            wait_ready(proc)
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    return started


def _engine_bases(model: str) -> Bases:
    chunk = WORKER_FLAGS["chunk_size"]
    sampling = common_pb2.SamplingParams(max_tokens=2)

    def prompt(k: int) -> list[int]:
        return [(7 * i + k) % 500 + 1 for i in range(chunk + 4 + k)]

    def decode(k: int) -> engine_pb2.DecodeRequest:
        request = engine_pb2.DecodeRequest(
            request_id=f"fz-{k}", model=model, prompt_token_ids=prompt(k), sampling=sampling
        )
        if k % 2:  # a handle to chunks nobody stored: the worker recomputes them
            request.kv.CopyFrom(
                common_pb2.KVHandle(
                    chunk_keys=[f"{k:064x}"],
                    tail_key=f"fz-tail-{k}",
                    num_tokens=len(request.prompt_token_ids),
                    chunk_size=chunk,
                    fingerprint=bytes(32),
                )
            )
            request.first_token_id = 5
        return request

    return {
        "PrefillService.Prefill": lambda k: engine_pb2.PrefillRequest(
            request_id=f"fz-{k}",
            model=model,
            prompt_token_ids=prompt(k),
            sampling=sampling,
            publish_incrementally=k % 2 == 1,
        ),
        "DecodeService.Decode": decode,
    }


class Engine(GrpcSurface):
    """A prefill worker's PrefillService and a decode worker's DecodeService."""

    name = "engine"

    def __init__(self, prefill: str, decode: str, model: str) -> None:
        routes = {
            **self.route(prefill, [engine_pb2.DESCRIPTOR.services_by_name["PrefillService"]]),
            **self.route(decode, [engine_pb2.DESCRIPTOR.services_by_name["DecodeService"]]),
        }
        super().__init__(routes, _engine_bases(model), "DecodeService.Decode")


# --- KV store -------------------------------------------------------------------------------

pb = kvstore_pb2


def _keys(k: int) -> pb.BatchKeysRequest:
    return pb.BatchKeysRequest(client_id="fz", keys=[f"fz-k{k}", f"fz-k{k + 1}"])


#: Valid KV master requests; the ``fz-`` ids never touch a real node's segments.
MASTER_BASES: Bases = {
    "KVMasterService.MountSegment": lambda k: pb.MountSegmentRequest(
        segment=pb.Segment(
            segment_id=f"fz-s{k}",
            node_id=f"fz-n{k}",
            size=1 << 20,
            endpoints=[pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")],
        ),
        held=[pb.HeldObject(key=f"fz-held{k}", offset=0, size=64)],
        keeps_bytes=k % 2 == 0,
    ),
    "KVMasterService.UnmountSegment": lambda k: pb.UnmountSegmentRequest(segment_id=f"fz-s{k}"),
    "KVMasterService.Heartbeat": lambda k: pb.NodeHeartbeatRequest(
        node_id=f"fz-n{k}", segment_ids=[f"fz-s{k}"]
    ),
    "KVMasterService.BatchPutStart": lambda k: pb.BatchPutStartRequest(
        client_id="fz",
        items=[pb.PutStartItem(key=f"fz-k{k}", size=100, checksum=bytes(16))],
        options=pb.PutOptions(replicas=1, ttl_ms=60_000),
    ),
    "KVMasterService.BatchPutEnd": _keys,
    "KVMasterService.BatchPutRevoke": _keys,
    "KVMasterService.BatchGetReplicaList": lambda k: pb.BatchGetReplicaListRequest(
        client_id="fz", keys=[f"fz-k{k}"], lease_ms=100
    ),
    "KVMasterService.BatchReleaseLease": _keys,
    "KVMasterService.BatchExists": _keys,
    "KVMasterService.LongestPrefix": lambda k: pb.LongestPrefixRequest(keys=_keys(k).keys),
    "KVMasterService.BatchRemove": _keys,
    "KVMasterService.Stats": lambda k: pb.StatsRequest(),
    "KVMasterService.WatchEvents": lambda k: pb.WatchEventsRequest(),
    "KVMasterService.GetControlWire": lambda k: pb.ControlWireRequest(),
    "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
}


#: Master flags of the store a fuzz run targets (:func:`pdserve.procs.local_store`): the tcp
#: surface's grants (:meth:`StoreTarget.of`) then last a day, the whole run.
STORE_MASTER_FLAGS: dict[str, object] = {"put_timeout_s": 86_400, "max_lease_ms": 86_400_000}

#: A tcp request range: segment key, offset, length, then its grant (as ``tcp.RANGE``).
TcpRange = tuple[int, int, int, int, int, int, int, bytes]


@dataclass
class StoreTarget:
    """A running master and storage node: the master's gRPC address and wire port, the node's
    gRPC address, its tcp data port and its segments (wire key -> size), and per grant op
    (read, write) a whole object's range with the grant the master gave for it (empty when
    the master runs with data tokens off)."""

    master: str
    wire_port: int
    node: str
    tcp: tuple[str, int]
    segments: dict[int, int]
    grants: dict[int, TcpRange] = field(default_factory=dict)

    @classmethod
    def of(cls, master_info: dict, node_info: dict) -> StoreTarget:
        """From the READY lines of a master (run with :data:`STORE_MASTER_FLAGS`) and a node
        (:func:`pdserve.procs.local_store`). Stores two objects for the tcp surface: one
        committed, its read grant leased for a day, and one whose put stays open, its write
        grant good until the put times out."""
        node = f"127.0.0.1:{node_info['port']}"
        with grpcutil.sync_channel(node) as ch:
            stats = grpc_call(
                ch, service_methods(_NODE)["KVNodeService.Stats"], b"", timeout=TIMEOUT_S
            )
        found = pb.NodeStatsResponse.FromString(stats[2][0])
        segments = {tcp.segment_key(s.segment_id): s.size for s in found.segments}
        return cls(
            master_info["grpc"],
            master_info["wire"],
            node,
            ("127.0.0.1", node_info["tcp_port"]),
            segments,
            _tcp_grants(master_info["grpc"], min(segments.values()) // 4),
        )


def _tcp_grants(master: str, size: int) -> dict[int, TcpRange]:
    """The read and the write grant of two ``size``-byte objects (see StoreTarget.of)."""
    from pdserve.store import grants

    def whole(rep: pb.Replica) -> TcpRange:
        seg = tcp.segment_key(rep.segment_id)
        return (seg, rep.offset, rep.size, rep.offset, rep.size, rep.token_expires_ms,
                rep.alloc_id, rep.token)  # fmt: skip

    with grpcutil.sync_channel(master) as ch:
        stub = kvstore_pb2_grpc.KVMasterServiceStub(ch)
        keys = ["fz-tcp-read", "fz-tcp-write"]
        start = stub.BatchPutStart(
            pb.BatchPutStartRequest(
                client_id="fz-tcp", items=[pb.PutStartItem(key=k, size=size) for k in keys]
            ),
            timeout=TIMEOUT_S,
        )
        stub.BatchPutEnd(pb.BatchKeysRequest(client_id="fz-tcp", keys=keys[:1]), timeout=TIMEOUT_S)
        got = stub.BatchGetReplicaList(
            pb.BatchGetReplicaListRequest(
                client_id="fz-tcp", keys=keys[:1], lease_ms=STORE_MASTER_FLAGS["max_lease_ms"]
            ),
            timeout=TIMEOUT_S,
        )
    read, write = got.results[0].replicas[0], start.results[1].replicas[0]
    if not read.token:
        return {}
    return {grants.OP_READ: whole(read), grants.OP_WRITE: whole(write)}


_MASTER = pb.DESCRIPTOR.services_by_name["KVMasterService"]
_NODE = pb.DESCRIPTOR.services_by_name["KVNodeService"]


class Master(GrpcSurface):
    """KVMasterService and the node's KVNodeService."""

    name = "master"
    endless = frozenset({"KVMasterService.WatchEvents"})

    def __init__(self, store: StoreTarget) -> None:
        routes = {**self.route(store.node, [_NODE]), **self.route(store.master, [_MASTER])}
        bases = {**MASTER_BASES, "KVNodeService.Stats": lambda k: pb.NodeStatsRequest()}
        super().__init__(routes, bases, "KVMasterService.Stats")

    def check_reply(self, case: Case, resp: Message) -> None:
        check_kv_results(resp, case.path, case.op)


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
def _mostly(draw, valid: Any, hostile: st.SearchStrategy) -> Any:
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
        hello = _mostly(wire.HELLO, st.binary(max_size=8) | st.just(wire.HELLO[:4] + b"\x02\0\0\0"))
        lie = _mostly("", st.sampled_from(["short", "oversize"]))
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
            if len(body) != length or status not in _CODES:
                raise Violation(f"wire: a malformed reply: status {status}, {len(body)}/{length}")
            pos += wire.FRAME.size + length
            return _CODES[status], body

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
            seg = draw(_mostly(target[0], st.sampled_from(keys) | ints(0, U64)))
            size = segs.get(seg, 4096)
            offset = draw(st.sampled_from([lo, hi - 1]) | st.integers(lo, hi - 1))
            offset = draw(_mostly(offset, st.sampled_from([size, size + 1, 2**63, U64])))
            room = max(hi - offset, 0)
            length = draw(st.integers(1, max(1, min(room, 1 << 16))))
            length = draw(_mostly(length, st.sampled_from([0, room, room + 1, U64])))
            grant = draw(_mostly(target[3:], hostile_grant(write)))
            return (seg, offset, length, *grant)

        @st.composite
        def request(draw) -> bytes:
            op = draw(_mostly(draw(st.sampled_from([1, 2, 3, 4])), ints(0, 255)))
            write = op in (tcp.OP_WRITE, tcp.OP_WRITEV)
            magic = draw(_mostly(tcp.REQ_MAGIC, st.binary(min_size=4, max_size=4)))
            version = draw(_mostly(tcp.VERSION, ints(0, 255)))
            reserved = draw(_mostly(0, ints(0, 0xFFFF)))
            if op in (tcp.OP_READV, tcp.OP_WRITEV):
                many = draw(_mostly(0, st.sampled_from([tcp.MAX_RANGES, tcp.MAX_RANGES + 1])))
                if many:  # the most ranges a request may have, or one more
                    target = self._target(write)
                    ranges = [(target[0], target[1], 1, *target[3:])] * many
                else:
                    ranges = draw(st.lists(one_range(write), min_size=1, max_size=6))
                count = draw(_mostly(len(ranges), st.sampled_from([0, len(ranges) + 1, U64])))
                head = tcp.REQ.pack(magic, version, op, reserved, 0, 0, count)
                head += b"".join(tcp.RANGE.pack(*r) for r in ranges)
                if write:
                    head += draw(_mostly(tcp.writev_pad(count), st.binary(max_size=64)))
            else:
                ranges = [draw(one_range(write))]
                head = tcp.REQ.pack(magic, version, op, reserved, *ranges[0][:3])
                head += tcp.GRANT.pack(*ranges[0][3:])
            need = sum(r[2] for r in ranges) if write else 0
            need = need if need <= self.MAX_PAYLOAD // 3 else 64
            sent = draw(_mostly(need, st.integers(0, need + 64)))
            return head + bytes(sent)

        tail = _mostly(b"", st.binary(max_size=40))
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


# --- meta -----------------------------------------------------------------------------------


def _instance(k: int) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=f"fz-{k}",
        role=common_pb2.ROLE_DECODE,
        address="127.0.0.1:9000",
        model="m",
        max_running=4,
        kv_capacity_bytes=1 << 30,
        load=common_pb2.Load(queue_length=1, kv_usage=0.5),
        labels={"metrics": "127.0.0.1:9001"},
    )


META_BASES: Bases = {
    "MetaService.Register": lambda k: meta_pb2.RegisterRequest(instance=_instance(k), ttl_ms=5000),
    "MetaService.Heartbeat": lambda k: meta_pb2.MetaHeartbeatRequest(
        lease_id=f"fz-lease-{k}", load=common_pb2.Load(running_requests=2, kv_usage=0.25)
    ),
    "MetaService.Deregister": lambda k: meta_pb2.DeregisterRequest(lease_id=f"fz-lease-{k}"),
    "MetaService.ListInstances": lambda k: meta_pb2.ListInstancesRequest(
        role=common_pb2.ROLE_DECODE, model="m"
    ),
    "MetaService.WatchInstances": lambda k: meta_pb2.WatchInstancesRequest(
        role=common_pb2.ROLE_DECODE, include_existing=k % 2 == 0
    ),
    "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
}


class Meta(GrpcSurface):
    """MetaService, and the Mooncake /metadata HTTP endpoint (hostile methods, keys and
    bodies)."""

    name = "meta"
    endless = frozenset({"MetaService.WatchInstances"})

    def __init__(self, grpc_address: str, http_address: str) -> None:
        routes = self.route(grpc_address, [meta_pb2.DESCRIPTOR.services_by_name["MetaService"]])
        super().__init__(routes, META_BASES, "MetaService.ListInstances")
        self.http = http_address

    def cases(self) -> st.SearchStrategy[Case]:
        key = st.sampled_from([None, "fz-key"]) | texts(small=True) | st.just("k" * 1025)
        body = pick([b'{"a": 1}', *RAW_BODIES]) | JSON.map(lambda v: json.dumps(v).encode())
        method = st.sampled_from(["GET", "PUT", "DELETE", "POST", "HEAD"])

        def http_case(method: str, key: str | None, body: bytes) -> Case:
            bad = key is None or not key.strip() or len(key.strip()) > 1024  # the documented rule
            return Case(f"{method} /metadata", body, "key" if bad else None, key)

        return super().cases() | st.builds(http_case, method, key, body)

    def check(self, case: Case) -> None:
        if not case.op.endswith(" /metadata"):
            return super().check(case)
        method, target = case.op.split(" ", 1)
        if case.extra is not None:
            target += "?" + urllib.parse.urlencode({"key": case.extra})
        status, reply = http_call(self.http, method, target, case.data)
        if status == 507 and b"http_max_keys" in reply:
            return  # the documented cap on stored keys: a full store, not a fault
        check_http(status, reply, case.path, case.op)
        if case.path and status != 400:
            raise Violation(f"{case.op}: a bad key answered {status}, not 400")

    def alive(self) -> None:
        super().alive()
        status, reply = http_call(self.http, "PUT", "/metadata?key=fz-alive", b'{"ok": 1}')
        if status != 200:
            raise Dead(f"meta: a valid PUT /metadata now answers {status}: {reply[:200]!r}")


# --- running --------------------------------------------------------------------------------


@dataclass
class Tally:
    surface: str
    cases: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def fuzz(surface: Surface, cases: int, *, collect: bool = False) -> Tally:
    """Runs ``cases`` hypothesis cases on ``surface``, each followed by a liveness check.
    A broken invariant raises (shrunk by hypothesis), or with ``collect`` is counted and the
    run goes on (until the server stops answering)."""
    tally = Tally(surface.name)
    phases = [Phase.generate] if collect else [Phase.generate, Phase.shrink]

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(surface.cases())
    def one(case: Case) -> None:
        tally.cases += 1
        try:
            surface.check(case)
            surface.alive()
        except Dead:
            raise
        except Exception as exc:
            if not collect:
                raise
            tally.failures.append(f"{type(exc).__name__}: {exc} <- {case!r}")

    start = time.monotonic()
    try:
        one()
    except Exception as exc:
        if not collect:
            raise
        tally.failures.append(f"{type(exc).__name__}: {exc}")
    tally.seconds = time.monotonic() - start
    return tally


def surfaces_for(names: list[str], stack: contextlib.ExitStack, log_dir: Path) -> list[Surface]:
    """Starts what ``names`` need, stopped with ``stack``: a KV store, torch prefill and decode
    workers on the tiny model, a real router in front of them, a meta; the surfaces in
    order."""
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store, service_args, start_service

    made: dict[str, Surface] = {}
    if set(names) - {"meta"}:
        master, node = stack.enter_context(
            local_store(log_dir, segment_size="4MiB", master_flags=STORE_MASTER_FLAGS)
        )
        store = StoreTarget.of(master.info, node.info)
        made.update(master=Master(store), wire=Wire(store), tcp=TcpPort(store))
    if {"router-http", "router-grpc", "engine"} & set(names):
        prefill, decode = start_workers(log_dir, store.master)
        stack.callback(prefill.stop)
        stack.callback(decode.stop)
        made["engine"] = Engine(prefill.info["grpc"], decode.info["grpc"], "tiny")
    if {"router-http", "router-grpc"} & set(names):
        router = start_service(
            "fuzz-router",
            service_args(
                "router",
                model=build_tiny_model(),
                served_name="tiny",
                prefill=prefill.info["grpc"],
                decode=decode.info["grpc"],
                port=0,
                http_port=0,
                max_tokens_limit=WORKER_FLAGS["max_tokens_limit"],
                default_max_tokens=8,
            ),
            log_dir,
        )
        stack.callback(router.stop)
        made["router-http"] = RouterHttp(router.info["http"].removeprefix("http://"), "tiny")
        made["router-grpc"] = RouterGrpc(router.info["grpc"], "tiny")
    if "meta" in names:
        meta = start_service(
            "fuzz-meta", service_args("meta", port=0, http_port=0, backend="memory"), log_dir
        )
        stack.callback(meta.stop)
        http_address = urllib.parse.urlsplit(meta.info["http"]).netloc
        made["meta"] = Meta(meta.info["grpc"], http_address)
    return [made[n] for n in names]


def run(args: argparse.Namespace) -> int:
    """``pdserve bench fuzz``: ``args.cases`` cases on each of ``args.surfaces``; prints a
    table and the failures; 0 when every invariant held."""
    names = [n.strip() for n in args.surfaces.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SURFACES))
    if unknown or not names:
        print(f"unknown surfaces {unknown}; choose from {', '.join(SURFACES)}")
        return 2
    tallies = []
    with contextlib.ExitStack() as stack:
        log_dir = getattr(args, "log_dir", None)
        log_dir = (
            Path(log_dir) if log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for surface in surfaces_for(names, stack, log_dir):
            tally = fuzz(surface, args.cases, collect=True)
            print(
                f"{tally.surface}: {tally.cases} cases, {len(tally.failures)} failures", flush=True
            )
            tallies.append(tally)
    print(f"\n{'surface':<12} {'cases':>8} {'failures':>9} {'seconds':>8} {'cases/s':>8}")
    for t in tallies:
        rate = t.cases / t.seconds if t.seconds else 0.0
        print(f"{t.surface:<12} {t.cases:>8} {len(t.failures):>9} {t.seconds:>8.1f} {rate:>8.1f}")
    for t in tallies:
        for failure in dict.fromkeys(t.failures[:20]):
            print(f"\n[{t.surface}] {failure}")
    return 1 if any(t.failures for t in tallies) else 0
