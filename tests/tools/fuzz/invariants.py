"""The invariants every answer to a fuzz case must keep: the statuses no input may
provoke, and an error that blames the input names the field the case corrupted."""

from __future__ import annotations

import re

import grpc
from google.protobuf.message import Message

from pdserve.v1 import kvstore_pb2

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
STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}


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
