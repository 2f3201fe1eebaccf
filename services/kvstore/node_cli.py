"""``pdserve kvstore node``: run a storage node (registered by services/kvstore/cli.py)."""

from __future__ import annotations

import argparse
import sys

from pdserve import config


def add_parser(kv_subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.kvstore.node_config import NodeConfig

    p = kv_subparsers.add_parser(
        "node",
        help="run a KV store storage node",
        description=(
            "Contributes memory segments to the KV store pool: mounts them at the master, "
            "heartbeats, and serves the data plane (shm for clients on this host, tcp, and "
            "mooncake when installed). Prints PDSERVE_READY with its ports once mounted."
        ),
    )
    config.add_arguments(p, NodeConfig)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve import lifecycle, telemetry
    from pdserve.services.kvstore.node import serve
    from pdserve.services.kvstore.node_config import NodeConfig
    from pdserve.store.segment import SegmentInUse

    try:
        cfg = config.from_args(NodeConfig, "kvstore_node", args)
    except config.ConfigError as exc:
        print(f"pdserve kvstore node: error: {exc}", file=sys.stderr)
        return 2
    telemetry.setup_logging("kvstore-node", cfg.log_level)
    try:
        return lifecycle.run(lambda stop: serve(cfg, stop))
    except SegmentInUse as exc:
        print(f"pdserve kvstore node: error: {exc}", file=sys.stderr)
        return 1
