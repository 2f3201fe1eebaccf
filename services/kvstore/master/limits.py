"""The master's input checks against its configured limits (ids, keys, batch sizes), shared by
the parts of :class:`~.state.MasterState` that take requests."""

from __future__ import annotations

from pdserve import errors
from pdserve.services.kvstore.master.config import MasterConfig


def check_id(cfg: MasterConfig, what: str, value: str) -> None:
    """INVALID_ARGUMENT unless ``value`` (a segment, node or client id) is set and short."""
    if not value:
        raise errors.InvalidArgument(f"{what} must not be empty")
    if len(value.encode()) > cfg.max_id_bytes:
        raise errors.InvalidArgument(
            f"{what} is {len(value.encode())} bytes; the limit is max_id_bytes={cfg.max_id_bytes}"
        )


def check_batch(cfg: MasterConfig, n: int, what: str = "keys") -> None:
    """Whole-call checks of a batched request."""
    if n == 0:
        raise errors.InvalidArgument(f"the request has no {what}")
    if n > cfg.max_batch_keys:
        raise errors.ResourceExhausted(
            f"the request has {n} {what}; the limit is max_batch_keys={cfg.max_batch_keys}"
        )


def key_problem(cfg: MasterConfig, key: str) -> str:
    """Why ``key`` is invalid, or "" when it is fine."""
    if not key:
        return "key is empty"
    n = len(key.encode())
    if n > cfg.max_key_bytes:
        return f"key is {n} bytes; the limit is max_key_bytes={cfg.max_key_bytes}"
    return ""
