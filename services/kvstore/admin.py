"""``pdserve kvstore namespaces | drop | quarantine``: whose KV the store holds (each root's
tenant too), dropping a model's chunks, and fingerprint quarantines (docs/kvstore.md,
"Namespaces"); ``pins`` is :mod:`.admin_pins`'s. Admin calls:
with a ``pdserve up`` running from ``--run-dir`` with TLS on, they dial the master as its
admin identity, as ``pdserve status`` does (unless PDSERVE_TLS_* say otherwise).

``drop --salt S`` computes the salt's chain roots here, from the listed fingerprints'
labels (:func:`pdserve.hashing.chain_root`): the salt never travels to the master.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdserve import errors

#: Exit status when a drop matched no fingerprint.
NOTHING = 1


def _master_address(args: argparse.Namespace) -> str:
    """``--master``, else the masters of the ``pdserve up`` in ``--run-dir``, else the master
    registered with its meta; configures the admin TLS identity of that ``up``."""
    from pdserve import identity
    from pdserve.commands.status import DEFAULT_META, supervised
    from pdserve.commands.up import admin_tls

    up = supervised(args.run_dir) or {}
    if up.get("tls") and identity.tls() is None:
        identity.configure_files(admin_tls(args.run_dir))
    if args.master:
        return args.master
    if up.get("kvstore_masters"):
        return ",".join(up["kvstore_masters"].values())
    return asyncio.run(_registered_master(up.get("meta") or DEFAULT_META, args.timeout))


async def _registered_master(meta: str, timeout: float) -> str:
    from pdserve.discovery import MetaClient
    from pdserve.enums import ROLE

    client = MetaClient(meta, call_timeout_s=timeout)
    try:
        instances = await client.list()
    finally:
        await client.close()
    for inst in instances:
        if ROLE.name(inst.role) == "kvstore-master" and inst.address:
            return inst.address
    raise errors.NotFound(f"no kvstore master registered with meta at {meta}; give --master")


def _client(args: argparse.Namespace) -> Any:
    from pdserve.store.client import StoreClient

    return StoreClient(_master_address(args), control="grpc", timeout_s=args.timeout)


def _row(fp: Any) -> dict[str, Any]:
    """A ``FingerprintUsage`` as plain data."""
    return {
        "fingerprint": fp.fingerprint,
        "model_id": fp.labels.get("model_id", ""),
        "model_revision": fp.labels.get("model_revision", ""),
        "objects": fp.objects,
        "bytes": fp.bytes,
        "roots": {
            r.root: {"objects": r.objects, "bytes": r.bytes, "tenant": r.tenant} for r in fp.roots
        },
        "quarantined": fp.quarantined,
        "quarantine_reason": fp.quarantine_reason,
        "quarantined_by": fp.quarantined_by,
        "idle_s": round(fp.idle_ms / 1000, 1),
    }


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'FINGERPRINT':<18} {'MODEL':<32} {'REVISION':<14} {'ROOTS':>5} {'OBJECTS':>8} "
        f"{'MIB':>10}  QUARANTINE"
    ]
    for r in rows:
        fp = r["fingerprint"][:16] or "(unknown)"
        q = f"yes: {r['quarantine_reason']}" if r["quarantined"] else ""
        lines.append(
            f"{fp:<18} {r['model_id'][:32]:<32} {r['model_revision'][:14]:<14} "
            f"{len(r['roots']):>5} {r['objects']:>8} {r['bytes'] / 2**20:>10.1f}  {q}"
        )
    return "\n".join(lines)


def select(
    fingerprints: Sequence[Any],
    *,
    model: str = "",
    revision: str = "",
    digests: Sequence[str] = (),
) -> list[Any]:
    """The listed fingerprints a drop names: those of ``digests``, and those whose labels
    say ``model`` (and ``revision`` when given)."""
    out = []
    for fp in fingerprints:
        if not fp.fingerprint:
            continue  # objects of no known namespace: no drop names them
        named = fp.fingerprint in digests
        if model and fp.labels.get("model_id") == model:
            named = named or not revision or fp.labels.get("model_revision") == revision
        if named:
            out.append(fp)
    return out


def salt_roots(fingerprints: Sequence[Any], salt: str) -> list[str]:
    """The chain roots of ``salt`` under each fingerprint (hex), from its labels; a tensor-
    parallel rank's chunks carry rank 0's root, which is computed too."""
    from pdserve import hashing

    roots: list[str] = []
    for fp in fingerprints:
        try:
            mf = hashing.ModelFingerprint.from_labels(fp.labels)
        except ValueError as exc:
            print(f"skipping {fp.fingerprint[:16]}: {exc}", file=sys.stderr)
            continue
        for f in (mf, dataclasses.replace(mf, tp_rank=0)):
            root = hashing.chain_root(f, salt).hex()
            if root not in roots:
                roots.append(root)
    return roots


def run_namespaces(args: argparse.Namespace) -> int:
    with _client(args) as client:
        rows = [_row(fp) for fp in client.list_namespaces()]
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


def run_drop(args: argparse.Namespace) -> int:
    if not args.model and not args.fingerprint:
        print("pdserve kvstore drop: give --model or --fingerprint", file=sys.stderr)
        return 2
    with _client(args) as client:
        chosen = select(
            client.list_namespaces(),
            model=args.model,
            revision=args.revision,
            digests=args.fingerprint,
        )
        if not chosen:
            print("no fingerprint matches; nothing dropped (see pdserve kvstore namespaces)")
            return NOTHING
        if args.salt:
            roots = salt_roots(chosen, args.salt)
            resp = client.drop_namespaces(roots=roots, dry_run=args.dry_run)
        else:
            resp = client.drop_namespaces([fp.fingerprint for fp in chosen], dry_run=args.dry_run)
    rows = [_row(fp) for fp in resp.dropped]
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "dropped": rows, "deferred": resp.deferred}))
        return 0
    verb = "would drop" if args.dry_run else "dropped"
    for r in rows:
        print(
            f"{verb} {r['objects']} objects ({r['bytes']} bytes) of {r['fingerprint']} "
            f"({r['model_id']} {r['model_revision']}, {len(r['roots'])} roots)"
        )
    if not rows:
        print(f"{verb} nothing: the store holds no object under the chosen roots")
    if resp.deferred:
        print(f"{resp.deferred} of them were being read: hidden now, freed when the read ends")
    return 0


def run_quarantine(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.clear:
            was = client.clear_quarantine(args.clear, args.reason)
            print(f"{args.clear}: {'cleared' if was else 'was not quarantined'}")
            return 0
        if args.set:
            was = client.set_quarantine(args.set, args.reason)
            print(f"{args.set}: {'already quarantined' if was else 'quarantined'}")
            return 0
        rows = [_row(fp) for fp in client.list_namespaces() if fp.quarantined]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(
                f"{r['fingerprint']}  {r['model_id']}  by {r['quarantined_by'] or '-'}: "
                f"{r['quarantine_reason']}"
            )
    return 0


def _guarded(run: Any) -> Any:
    """``run`` with store errors printed as one line (exit 1) instead of a traceback."""

    def call(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except errors.PdserveError as exc:
            print(f"pdserve kvstore {args.kvstore_command}: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # the run dir's admin identity files
            print(f"pdserve kvstore {args.kvstore_command}: {exc}", file=sys.stderr)
            return 2

    return call


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master",
        default="",
        help="KV master address (HOST:PORT, or every master's of an HA setup) (default: the "
        "masters of the `pdserve up` running from --run-dir, else the one registered with its "
        "meta)",
    )
    p.add_argument(
        "--run-dir",
        default=".pdserve/run",
        help="run dir of a `pdserve up`: its masters, and with its TLS on its admin identity "
        "(default: %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="per-call timeout in seconds")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_admin_commands(kv_sub: argparse._SubParsersAction) -> None:
    """Registers ``namespaces``, ``drop`` and ``quarantine`` under ``pdserve kvstore``."""
    ns = kv_sub.add_parser(
        "namespaces",
        help="list the model fingerprints the KV store holds chunks of (admin)",
        description="Each fingerprint with its model, revision, chain roots, objects, bytes, "
        "quarantine and idle time; '(unknown)' counts objects of no known fingerprint.",
    )
    _common(ns)
    ns.set_defaults(func=_guarded(run_namespaces))
    drop = kv_sub.add_parser(
        "drop",
        help="remove a model's KV chunks from the store's memory and disk tiers (admin)",
        description="Removes every object of the matching fingerprints (all their chain "
        "roots; with --salt only that cache salt's roots, computed here) from memory and disk, "
        "dormant ones included; other fingerprints are untouched. Objects being read are "
        "hidden at once and freed when the read lease ends. Exit 1 when nothing matches.",
    )
    _common(drop)
    drop.add_argument("--model", default="", help="the fingerprints whose model_id is NAME")
    drop.add_argument("--revision", default="", help="only those of this model_revision")
    drop.add_argument("--salt", default="", help="only the chunks of this cache salt")
    drop.add_argument(
        "--fingerprint", action="append", default=[], help="a fingerprint digest (hex; repeat)"
    )
    drop.add_argument("--dry-run", action="store_true", help="only say what would be dropped")
    drop.set_defaults(func=_guarded(run_drop))
    q = kv_sub.add_parser(
        "quarantine",
        help="list, set or clear fingerprint quarantines (admin)",
        description="A quarantined fingerprint's chunks read as not found and its puts are "
        "refused, so workers recompute; the router's production check sets it, an admin "
        "clears it (drop the chunks first when they are bad).",
    )
    _common(q)
    how = q.add_mutually_exclusive_group()
    how.add_argument("--list", action="store_true", help="list the quarantines (default)")
    how.add_argument("--clear", metavar="FP", default="", help="clear FP's quarantine")
    how.add_argument("--set", metavar="FP", default="", help="quarantine FP (needs --reason)")
    q.add_argument("--reason", default="", help="why (with --set; logged with --clear)")
    q.set_defaults(func=_guarded(run_quarantine))
