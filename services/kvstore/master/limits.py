"""The master's input checks against its configured limits (ids, keys, batch sizes), shared by
the parts of :class:`~.state.MasterState` that take requests."""

from __future__ import annotations

from collections.abc import Sequence

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


def check_put(
    cfg: MasterConfig,
    n_items: int,
    replicas: int,
    ttl_ms: int,
    inline: Sequence[object],
    checksums: Sequence[object],
    blocks: Sequence[object],
    spaces: Sequence[object] = (),
) -> int:
    """Whole-call checks of a put start (``inline``, ``checksums``, ``blocks`` and
    ``spaces``: empty, or one per item); returns the replica count to place (0 asks for the
    default)."""
    check_batch(cfg, n_items, "items")
    for what, given in (
        ("block metadata", blocks),
        ("inline payloads", inline),
        ("namespace indexes", spaces),
    ):
        if given and len(given) != n_items:
            raise errors.InvalidArgument(f"{len(given)} {what} for {n_items} items")
    if checksums and len(checksums) != n_items:
        raise errors.InvalidArgument(f"{len(checksums)} checksums for {n_items} items")
    n_rep = replicas or cfg.default_replicas
    if n_rep > cfg.max_replicas:
        raise errors.InvalidArgument(
            f"options.replicas={replicas} exceeds max_replicas={cfg.max_replicas}"
        )
    if ttl_ms > cfg.max_ttl_ms:
        raise errors.InvalidArgument(f"options.ttl_ms={ttl_ms} exceeds max_ttl_ms={cfg.max_ttl_ms}")
    return n_rep
