"""The KV store client side: :func:`open_store` picks a backend ("pdserve" or "mooncake")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.store.api import StoreBackend

BACKENDS = ("pdserve", "mooncake")


def open_store(master_address: str, *, backend: str = "pdserve", **kwargs: Any) -> StoreBackend:
    """A store client: pdserve's own store (``StoreClient``) or a Mooncake Store cluster
    (``MooncakeStoreClient``); ``kwargs`` go to the backend's constructor."""
    if backend == "pdserve":
        from pdserve.store.client import StoreClient

        return StoreClient(master_address, **kwargs)
    if backend == "mooncake":
        from pdserve.store.mooncake_backend import MooncakeStoreClient

        return MooncakeStoreClient(master_address, **kwargs)
    raise ValueError(f"store backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
