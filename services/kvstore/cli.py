"""``pdserve kvstore``: the KV store's processes, ``master`` (metadata and allocation) and
``node`` (a storage node), and its admin commands (:mod:`.admin`: ``namespaces``, ``drop``,
``quarantine``)."""

from __future__ import annotations

import argparse

from pdserve.commands.service import add_service_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.kvstore.master.config import MasterConfig
    from pdserve.services.kvstore.node.config import NodeConfig

    kv = subparsers.add_parser(
        "kvstore",
        help="KV store master and storage nodes",
        description="The pooled KV store: one master (metadata, allocation) and storage nodes.",
    )
    kv_sub = kv.add_subparsers(dest="kvstore_command", metavar="<kvstore command>")
    add_service_command(
        kv_sub,
        "master",
        config_cls=MasterConfig,
        section="kvstore_master",
        serve="pdserve.services.kvstore.master.serve:serve",
        service="kvstore-master",
        help="run the KV store master (metadata and allocation, no payload bytes)",
        description=(
            "Runs the KV store master: segments, objects, replicas, read leases, soft pins, "
            "TTLs, LRU eviction between watermarks, dead-node detection and an event stream. "
            "Committed-object metadata is kept in SQLite under --state-dir (default "
            "~/.local/state/pdserve/kvstore-master), so a restarted master serves every object "
            "again once its node remounts; a node that misses its heartbeats has its objects "
            "hidden, not deleted, until it remounts or dormant_grace_s passes."
        ),
    )
    add_service_command(
        kv_sub,
        "node",
        config_cls=NodeConfig,
        section="kvstore_node",
        serve="pdserve.services.kvstore.node.serve:serve",
        service="kvstore-node",
        help="run a KV store storage node",
        description=(
            "Contributes memory segments to the KV store pool: mounts them at the master, "
            "heartbeats, and serves the data plane (shm for clients on this host, tcp, and "
            "mooncake when installed). Prints PDSERVE_READY with its ports once mounted."
        ),
    )
    from pdserve.services.kvstore.admin import add_admin_commands
    from pdserve.services.kvstore.admin_pins import add_pins_command

    add_admin_commands(kv_sub)
    add_pins_command(kv_sub)
    kv.set_defaults(func=lambda _args: kv.print_help() or 2)
