"""The interface every meta backend implements: instance records under TTL leases, a watch
stream of changes, and a flat key-value space for the Mooncake HTTP metadata endpoint.

Records are ``pdserve.v1.Instance`` messages, ``owner`` included; backends that persist them
store JSON (``google.protobuf.json_format``), never pickle. Validation happens above, in
:class:`pdserve.services.meta.registry.Registry`: a backend may assume well-formed input.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from pdserve.v1 import common_pb2, meta_pb2


class Backend(ABC):
    """Storage for the registry. One instance per meta process; all methods run on its event
    loop and must not block it."""

    @abstractmethod
    async def start(self) -> None:
        """Connects / starts background tasks (expiry). Called once before any other method;
        raises :class:`pdserve.errors.Unavailable` when the store cannot be reached."""

    @abstractmethod
    async def close(self) -> None:
        """Stops background tasks and ends every open :meth:`watch` iterator. Idempotent."""

    @abstractmethod
    async def register(self, instance: meta_pb2.Instance, ttl_ms: int) -> tuple[str, int]:
        """Stores ``instance`` (its ``lease_id`` and ``updated_ms`` are set here) under a new
        lease of ``ttl_ms`` and returns ``(lease_id, granted_ttl_ms)``; the granted TTL may be
        longer when the store has a coarser clock (etcd: whole seconds, >= its minimum).

        An instance already registered under the same ``instance_id`` is replaced (UPDATED
        event) and its old lease revoked. Lease ids are never reused, also across restarts of
        an in-memory backend, so a stale id is always NOT_FOUND."""

    @abstractmethod
    async def heartbeat(self, lease_id: str, load: common_pb2.Load | None) -> int:
        """Renews the lease and returns its remaining TTL (ms). With ``load`` the record's load
        and ``updated_ms`` are rewritten (UPDATED event); without it only the lease is renewed
        (no event). Raises :class:`pdserve.errors.NotFound` for an unknown or expired lease."""

    @abstractmethod
    async def deregister(self, lease_id: str) -> None:
        """Removes the lease and its instance (LEFT event). Raises ``NotFound`` when unknown."""

    @abstractmethod
    async def lookup(self, lease_id: str) -> meta_pb2.Instance:
        """The record a live lease keeps (the registry checks its owner before a heartbeat or
        deregistration it has not seen yet). Raises ``NotFound`` like :meth:`heartbeat`."""

    @abstractmethod
    async def list(self) -> list[meta_pb2.Instance]:
        """Every live instance (no particular order)."""

    @abstractmethod
    async def watch(self) -> AsyncIterator[meta_pb2.InstanceEvent]:
        """Returns an iterator of the events after this call returns (the subscription is
        established before it returns, so nothing between the return and the first read is
        lost), in the order the store applied them: JOINED on first
        registration, UPDATED on re-registration or a heartbeat with load, LEFT (carrying the
        last record) on deregistration or lease expiry. Ends when the backend closes."""

    @abstractmethod
    async def kv_get(self, key: str) -> bytes | None:
        """The value stored under ``key`` in the metadata key space, or None."""

    @abstractmethod
    async def kv_put(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key`` (overwrites). Never expires."""

    @abstractmethod
    async def kv_delete(self, key: str) -> bool:
        """Deletes ``key``; False when it was absent."""

    @abstractmethod
    async def kv_count(self) -> int:
        """How many keys the metadata key space holds."""

    @abstractmethod
    async def kv_bytes(self) -> int:
        """Total size of the values the metadata key space holds (bytes). May read every
        value (etcd): the HTTP endpoint asks once, then keeps its own count."""
