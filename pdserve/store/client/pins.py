"""The store client's calls about tenants' pins and shares (docs/architecture.md, "Tenant shares
and pins"): pin a tenant's chunk keys, unpin them, list the pins and every tenant's use of the
pool. The master takes them from the ``router`` identity (which authenticates tenants) or
``admin``; a refusal raises PermissionDenied, a pin past the tenant's memory share
ResourceExhausted naming the share and the size."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.store.client.control import MasterLink
from pdserve.v1 import kvstore_pb2


def pin_keys(
    master: MasterLink, tenant: str, name: str, keys: Sequence[str]
) -> kvstore_pb2.PinKeysResponse:
    """Pins ``keys`` (chunk keys, chain order) for ``tenant`` as ``name`` (replacing a pin
    of that name); keys not stored yet are pinned when their put commits."""
    request = kvstore_pb2.PinKeysRequest(tenant=tenant, name=name, keys=list(keys))
    return master.call("PinKeys", request)


def unpin_keys(master: MasterLink, tenant: str, name: str) -> bool:
    """Removes ``tenant``'s pin ``name``; False when there was none."""
    request = kvstore_pb2.UnpinKeysRequest(tenant=tenant, name=name)
    return bool(master.call("UnpinKeys", request).removed)


def list_pins(master: MasterLink, tenant: str = "") -> kvstore_pb2.ListPinsResponse:
    """The pins and each tenant's use of the pool (only ``tenant``'s when given)."""
    return master.call("ListPins", kvstore_pb2.ListPinsRequest(tenant=tenant))
