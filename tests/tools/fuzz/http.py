"""Fuzzing HTTP: a raw request on a fresh connection, hostile JSON values and bodies, and
one corrupted key of a valid JSON body."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st

from .invariants import (
    TIMEOUT_S,
    Violation,
)
from .strategies import (
    FLOAT_EDGES,
    ints,
    texts,
)


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
