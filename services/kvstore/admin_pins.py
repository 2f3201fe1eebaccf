"""``pdserve kvstore pins``: tenants' pins and each tenant's use of the pool (docs/architecture.md,
"Tenant shares and pins"), dialing the master as :mod:`.admin`'s commands do (the run dir's
admin identity with TLS on)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdserve.services.kvstore.admin import _client, _common, _guarded


def rows(resp: Any) -> dict[str, list[dict[str, Any]]]:
    """A ``ListPinsResponse`` as plain data."""
    pins = [
        {
            "tenant": p.tenant,
            "name": p.name,
            "chunks": p.keys,
            "stored_chunks": p.present,
            "bytes": p.bytes,
            "created_ms": p.created_ms,
        }
        for p in resp.pins
    ]
    tenants = [
        {
            "tenant": t.tenant,
            "memory_bytes": t.memory_bytes,
            "memory_share_bytes": t.memory_share_bytes,
            "disk_bytes": t.disk_bytes,
            "disk_share_bytes": t.disk_share_bytes,
            "pinned_bytes": t.pinned_bytes,
            "evictions_over_share": t.evictions_over_share,
            "evictions_normal": t.evictions_normal,
        }
        for t in resp.tenants
    ]
    return {"pins": pins, "tenants": tenants}


def table(data: dict[str, list[dict[str, Any]]]) -> str:
    mib = 2**20
    lines = [f"{'TENANT':<20} {'PIN':<24} {'CHUNKS':>7} {'STORED':>7} {'MIB':>9}"]
    for p in data["pins"]:
        lines.append(
            f"{p['tenant'] or '(none)':<20} {p['name'][:24]:<24} {p['chunks']:>7} "
            f"{p['stored_chunks']:>7} {p['bytes'] / mib:>9.1f}"
        )
    lines += [
        "",
        f"{'TENANT':<20} {'MEMORY MIB':>11} {'SHARE MIB':>10} {'DISK MIB':>9} {'SHARE MIB':>10} "
        f"{'PINNED MIB':>11} {'EVICTED OVER':>13} {'NORMAL':>7}",
    ]
    for t in data["tenants"]:
        lines.append(
            f"{t['tenant'] or '(none)':<20} {t['memory_bytes'] / mib:>11.1f} "
            f"{t['memory_share_bytes'] / mib:>10.1f} {t['disk_bytes'] / mib:>9.1f} "
            f"{t['disk_share_bytes'] / mib:>10.1f} {t['pinned_bytes'] / mib:>11.1f} "
            f"{t['evictions_over_share']:>13} {t['evictions_normal']:>7}"
        )
    return "\n".join(lines)


def run_pins(args: argparse.Namespace) -> int:
    from pdserve.store.client import pins

    with _client(args) as client:
        data = rows(pins.list_pins(client.master, args.tenant))
    print(json.dumps(data, indent=2) if args.json else table(data))
    return 0


def add_pins_command(kv_sub: argparse._SubParsersAction) -> None:
    """Registers ``pins`` under ``pdserve kvstore``."""
    p = kv_sub.add_parser(
        "pins",
        help="list tenants' pinned prefixes and each tenant's use of the store (admin)",
        description="Each pin (tenant, name, chunks named, chunks stored, bytes) and each "
        "tenant's bytes per tier against its share (kvstore_master.tenant_shares), pinned "
        "bytes and evictions (over its share / normal). Pins are made through the router "
        "(POST /v1/pdserve/pins).",
    )
    _common(p)
    p.add_argument("--tenant", default="", help="only this tenant's pins and use")
    p.set_defaults(func=_guarded(run_pins))
