"""Hypothesis strategies of hostile values: edge numbers and strings per protobuf field
type, whole messages, one corrupted field of a valid message, and raw malformed encodings."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

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
