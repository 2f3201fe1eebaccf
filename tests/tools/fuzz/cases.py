"""A fuzz case (:class:`Case`) and what a fuzzed surface offers (:class:`Surface`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf import text_format
from google.protobuf.message import Message
from hypothesis import strategies as st


def short(value: Any, limit: int = 400) -> str:
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
            head += f", {self.path}={short(at(self.data, self.path), 200)}"
        return f"{head}, data={short(self.data)}, extra={short(self.extra)})"


def at(data: Any, path: str) -> Any:
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
