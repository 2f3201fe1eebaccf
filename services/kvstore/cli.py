"""``pdserve kvstore``: the KV store's processes.

* ``pdserve kvstore master``: metadata and allocation (this module).
* ``pdserve kvstore node``: a storage node; registered by
  ``pdserve.services.kvstore.node_cli.add_parser(kv_sub)`` when that module exists.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from pdserve import config
from pdserve.services.kvstore.master_config import MasterConfig

#: Modules that add more ``pdserve kvstore <sub>`` commands via ``add_parser(kv_sub)``.
EXTRA_SUBCOMMAND_MODULES = ["pdserve.services.kvstore.node_cli"]


def _run_master(args: argparse.Namespace) -> int:
    from pdserve import lifecycle, telemetry
    from pdserve.services.kvstore.master import serve

    cfg = config.from_args(MasterConfig, "kvstore_master", args)
    telemetry.setup_logging("kvstore-master", cfg.log_level)
    return lifecycle.run(lambda stop: serve(cfg, stop))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    kv = subparsers.add_parser(
        "kvstore",
        help="KV store master and storage nodes",
        description="The pooled KV store: one master (metadata, allocation) and storage nodes.",
    )
    kv_sub = kv.add_subparsers(dest="kvstore_command", metavar="<kvstore command>")
    master = kv_sub.add_parser(
        "master",
        help="run the KV store master (metadata and allocation, no payload bytes)",
        description=(
            "Runs the KV store master: segments, objects, replicas, read leases, soft pins, "
            "TTLs, LRU eviction between watermarks, dead-node detection and an event stream. "
            "With --state-dir, committed-object metadata survives a restart (SQLite)."
        ),
    )
    config.add_arguments(master, MasterConfig)
    master.set_defaults(func=_run_master)
    kv.set_defaults(func=lambda _args: kv.print_help() or 2)
    # --- other kvstore subcommands (e.g. `node`) register themselves here ---
    for name in EXTRA_SUBCOMMAND_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name).add_parser(kv_sub)
