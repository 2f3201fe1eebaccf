"""The store client's calls about whose KV the store holds (docs/kvstore.md, "Namespaces"):
list the model fingerprints and their chain roots, drop them, quarantine them. Admin calls
but :func:`set_quarantine`, which the router's identity may make too (the master decides;
a refusal raises PermissionDenied)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdserve import errors
from pdserve.store.client.control import MasterLink
from pdserve.v1 import kvstore_pb2

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Longest quarantine reason the master keeps (characters).
MAX_REASON = 1024


def check_hex(what: str, value: str) -> str:
    """``value`` when it is 64 lowercase hex characters (a digest or chain root); else
    InvalidArgument naming ``what``."""
    if not isinstance(value, str) or _HEX64.fullmatch(value) is None:
        raise errors.InvalidArgument(f"{what} must be 64 lowercase hex characters, got {value!r}")
    return value


def list_namespaces(master: MasterLink) -> list[kvstore_pb2.FingerprintUsage]:
    """Every fingerprint the master knows, with roots, objects, bytes and quarantine."""
    return list(master.call("ListNamespaces", kvstore_pb2.ListNamespacesRequest()).fingerprints)


def drop_namespaces(
    master: MasterLink,
    fingerprints: Sequence[str] = (),
    roots: Sequence[str] = (),
    *,
    dry_run: bool = False,
) -> kvstore_pb2.DropNamespacesResponse:
    """Removes every object of ``fingerprints`` (all their roots) and under ``roots`` from
    the store's memory and disk tiers; with ``dry_run`` only says what would go."""
    fps = [check_hex("fingerprint", f) for f in fingerprints]
    rts = [check_hex("root", r) for r in roots]
    if not fps and not rts:
        raise errors.InvalidArgument("drop_namespaces needs a fingerprint or a root")
    request = kvstore_pb2.DropNamespacesRequest(fingerprints=fps, roots=rts, dry_run=dry_run)
    return master.call("DropNamespaces", request)


def set_quarantine(
    master: MasterLink, fingerprint_hex: str, reason: str, *, quarantined: bool = True
) -> kvstore_pb2.SetQuarantineResponse:
    """Quarantines ``fingerprint_hex`` (its chunks read as not found, its puts are refused)
    or, with ``quarantined`` False, clears it (admin only)."""
    check_hex("fingerprint", fingerprint_hex)
    if quarantined and not reason.strip():
        raise errors.InvalidArgument("a quarantine needs a reason")
    if len(reason) > MAX_REASON:
        raise errors.InvalidArgument(f"reason is longer than {MAX_REASON} characters")
    request = kvstore_pb2.SetQuarantineRequest(
        fingerprint=fingerprint_hex, quarantined=quarantined, reason=reason
    )
    return master.call("SetQuarantine", request)
