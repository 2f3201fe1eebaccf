"""``pdserve status``: what is registered, healthy and loaded, and how full the KV store is."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import grpc


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


async def collect(meta: str, store_master: str, timeout: float) -> dict:
    """Everything status shows, as plain data (JSON-friendly)."""
    from pdserve import grpcutil
    from pdserve.discovery import MetaClient
    from pdserve.enums import ROLE
    from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    client = MetaClient(meta, call_timeout_s=timeout)
    try:
        instances = await client.list()
    finally:
        await client.close()
    rows = []
    for inst in sorted(instances, key=lambda i: (i.role, i.instance_id)):
        role = ROLE.name(inst.role)
        public = role == "router"  # its gRPC port is the public API
        healthy = (
            await grpcutil.check_health(inst.address, timeout, public=public)
            if inst.address
            else False
        )
        rows.append(
            {
                "id": inst.instance_id,
                "role": role,
                "address": inst.address,
                "model": inst.model,
                "healthy": healthy,
                "queue": inst.load.queue_length,
                "running": inst.load.running_requests,
                "kv_usage": round(inst.load.kv_usage, 4),
                # workers: the KV fingerprint they registered (services/worker.py)
                "fingerprint": inst.labels.get("fingerprint", ""),
                # workers: "on", "none" (no store configured) or "off: <why>"
                "kv_store": inst.labels.get("kv_store", ""),
            }
        )
    if not store_master:
        registered = [r["address"] for r in rows if r["role"] == "kvstore-master"]
        store_master = registered[0] if registered else ""
    masters = []
    if "," in store_master:  # HA masters: one leads, the standbys bind nothing
        masters = [
            {"address": a, "leading": await grpcutil.check_health(a, timeout)}
            for a in store_master.split(",")
        ]
        store_master = next((m["address"] for m in masters if m["leading"]), "")
    store = None
    if store_master:
        async with grpcutil.channel(store_master) as ch:
            stats = await kvstore_pb2_grpc.KVMasterServiceStub(ch).Stats(
                kvstore_pb2.StatsRequest(), timeout=timeout
            )
        store = {
            "address": store_master,
            "objects": stats.objects,
            "used_bytes": stats.used_bytes,
            "capacity_bytes": stats.capacity_bytes,
            "memory_used_bytes": sum(
                g.used
                for g in stats.segments
                if g.alive and g.tier == kvstore_pb2.STORAGE_TIER_MEMORY
            ),
            "disk_used_bytes": stats.disk_used_bytes,
            "disk_capacity_bytes": stats.disk_capacity_bytes,
            "demotions": stats.demotions,
            "promotions": stats.promotions,
            "alive_nodes": stats.alive_nodes,
            "puts": stats.puts,
            "gets": stats.gets,
            "get_hits": stats.get_hits,
            "evictions": stats.evictions,
        }
    return {"meta": meta, "instances": rows, "store": store, "masters": masters}


def render(report: dict) -> str:
    lines = [f"meta {report['meta']}: {len(report['instances'])} instance(s)"]
    width = max([18, *(len(r["id"]) for r in report["instances"])])
    fmt = "  {:<" + str(width) + "} {:<15} {:<22} {:<8} {:>5} {:>7} {:>8}  {}"
    lines.append(
        fmt.format("ID", "ROLE", "ADDRESS", "HEALTHY", "QUEUE", "RUNNING", "KV USE", "MODEL")
    )
    for r in report["instances"]:
        lines.append(
            fmt.format(
                r["id"],
                r["role"],
                r["address"],
                "yes" if r["healthy"] else "NO",
                r["queue"],
                r["running"],
                f"{100 * r['kv_usage']:.1f}%",
                r["model"],
            )
        )
    for r in report["instances"]:
        if r.get("kv_store", "").startswith("off"):
            lines.append(f"  {r['id']} serves WITHOUT the KV store ({r['kv_store']})")
    by_fp: dict[str, list[str]] = {}
    for r in report["instances"]:
        if r.get("fingerprint"):
            by_fp.setdefault(r["fingerprint"], []).append(r["id"])
    if len(by_fp) > 1:
        lines.append(
            "workers registered different KV fingerprints (a router refuses those that differ "
            "from its own; its ListModels names them): "
            + "; ".join(f"{fp[:12]}: {', '.join(ids)}" for fp, ids in sorted(by_fp.items()))
        )
    store = report["store"]
    if store:
        cap = store["capacity_bytes"]
        used = store["memory_used_bytes"]
        pct = 100 * used / cap if cap else 0.0
        lines.append(
            f"KV store {store['address']}: {store['objects']} objects, memory "
            f"{_gib(used)} of {_gib(cap)} used ({pct:.1f}%), "
            f"{store['alive_nodes']} node(s) alive, hit rate "
            f"{store['get_hits']}/{store['gets']}, {store['evictions']} evictions"
        )
        disk_cap = store["disk_capacity_bytes"]
        if disk_cap:
            lines.append(
                f"  disk tier: {_gib(store['disk_used_bytes'])} of {_gib(disk_cap)} used "
                f"({100 * store['disk_used_bytes'] / disk_cap:.1f}%), "
                f"{store['demotions']} copied down, {store['promotions']} back up"
            )
        else:
            lines.append("  disk tier: none (nodes run without --disk-path)")
    elif report.get("masters"):
        lines.append("KV store: no master leads")
    else:
        lines.append("KV store: no master registered")
    up = report.get("supervised")
    if report.get("masters"):
        names = {a: n for n, a in ((up or {}).get("kvstore_masters") or {}).items()}
        lines.append("KV store masters (one leads; etcd elects it):")
        for m in report["masters"]:
            name = f" ({names[m['address']]})" if m["address"] in names else ""
            what = "leading" if m["leading"] else "standby (not serving)"
            lines.append(f"  {m['address']}{name}: {what}")
    if up:
        lines.append(
            f"pdserve up (pid {up['up_pid']}) supervises {len(up['services'])} service(s):"
        )
        fmt = "  {:<22} {:>8} {:<11} {:>8}  {}"
        lines.append(fmt.format("SERVICE", "PID", "STATE", "RESTARTS", "LAST EXIT"))
        for r in up["services"]:
            last = "-" if r["last_exit"] is None else str(r["last_exit"])
            lines.append(fmt.format(r["name"], r["pid"], r["state"], r["restarts"], last))
        for e in up.get("external_engines", []):
            lines.append(
                f"  external engine {e['url']} ({e['role']}): not started or restarted by up"
            )
    return "\n".join(lines)


#: Where meta listens unless told otherwise (``pdserve up``'s meta_port on loopback).
DEFAULT_META = "127.0.0.1:50050"


def supervised(run_dir: str) -> dict | None:
    """What a running ``pdserve up`` wrote about its services (None when none runs there)."""
    from pdserve.commands.up import SERVICES_FILE

    try:
        data = json.loads((Path(run_dir) / SERVICES_FILE).read_text())
        os.kill(int(data["up_pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data


def run(args: argparse.Namespace) -> int:
    from pdserve import identity
    from pdserve.commands.up import admin_tls

    up = supervised(args.run_dir)
    if up and up.get("tls") and identity.tls() is None:
        # no PDSERVE_TLS_* given: dial the mutual-TLS services as that `pdserve up`'s admin
        try:
            identity.configure_files(admin_tls(args.run_dir))
        except ValueError as exc:
            print(f"pdserve status: {exc}", file=sys.stderr)
            return 2
    if not args.meta:  # the meta of the `pdserve up` in --run-dir, else the default port
        args.meta = (up or {}).get("meta") or DEFAULT_META
    if not args.store_master and (up or {}).get("kvstore_masters"):  # its HA masters
        args.store_master = ",".join(up["kvstore_masters"].values())
    try:
        report = asyncio.run(collect(args.meta, args.store_master, args.timeout))
    except grpc.aio.AioRpcError as exc:
        hint = ""
        if identity.tls() is None:
            hint = (
                " (services with mutual TLS need PDSERVE_TLS_CA, _CERT and _KEY, or the "
                "--run-dir of their `pdserve up`)"
            )
        print(f"pdserve status: cannot reach {args.meta}: {exc.details()}{hint}", file=sys.stderr)
        if up:
            print(render({"meta": args.meta, "instances": [], "store": None, "supervised": up}))
        return 1
    report["supervised"] = up
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if all(r["healthy"] for r in report["instances"]) else 1


def run_health(args: argparse.Namespace) -> int:
    from pdserve import grpcutil

    ok = asyncio.run(grpcutil.check_health(args.address, args.timeout))
    if not ok and args.standby_ok and _refused(args.address, args.timeout):
        print(f"{args.address}: nothing listens (a standby KV master)")
        return 0
    print(f"{args.address}: {'SERVING' if ok else 'NOT SERVING or unreachable'}")
    return 0 if ok else 1


def _refused(address: str, timeout: float) -> bool:
    """Whether ``address`` refuses TCP connections (nothing listens there)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    h = subparsers.add_parser(
        "health",
        help="check one service's gRPC health (for container healthchecks)",
        description="Exit code 0 when the gRPC server at ADDRESS answers grpc.health.v1 SERVING.",
    )
    h.add_argument("address", help="host:port of any pdserve gRPC server")
    h.add_argument("--timeout", type=float, default=2.0, help="seconds (default: %(default)s)")
    h.add_argument(
        "--standby-ok",
        action="store_true",
        help="exit 0 too when nothing listens at ADDRESS: a KV master's probe from inside its "
        "own pod or container, where the master runs, so a closed port is a standby (it binds "
        "nothing until it leads); a server that accepts but does not answer SERVING still fails",
    )
    h.set_defaults(func=run_health)
    p = subparsers.add_parser(
        "status",
        help="show registered services, their health and load, and KV store usage",
        description=(
            "Lists every instance registered with meta (role, address, health, queue, running "
            "requests, KV usage) and the KV store's fill level. Exit code 1 when any "
            "registered instance is unhealthy. With a `pdserve up` running from --run-dir, also "
            "each service it supervises: pid, state, restarts and last exit code."
        ),
    )
    p.add_argument(
        "--meta",
        default="",
        help="meta gRPC address (default: that of the `pdserve up` running from --run-dir, "
        f"else {DEFAULT_META})",
    )
    p.add_argument(
        "--store-master",
        default="",
        help="KV store master address, or every master's of an HA setup (HOST:PORT,HOST:PORT: "
        "status shows which leads) (default: the masters of the `pdserve up` running from "
        "--run-dir, else the one registered with meta)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="per-call timeout in seconds")
    p.add_argument(
        "--run-dir",
        default=".pdserve/run",
        help="run dir of a `pdserve up` whose supervision (restarts, last exits) to show too; "
        "with its TLS on, status dials the services as its admin identity (<run-dir>/certs) "
        "unless PDSERVE_TLS_* say otherwise (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
