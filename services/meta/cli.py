"""``pdserve meta``: run the service registry (gRPC) and the Mooncake HTTP metadata endpoint."""

from __future__ import annotations

import argparse

from pdserve.commands.service import add_service_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.meta.server import MetaConfig

    add_service_command(
        subparsers,
        "meta",
        config_cls=MetaConfig,
        section="meta",
        serve="pdserve.services.meta.server:serve",
        help="service registry with TTL leases and watches; Mooncake HTTP metadata server",
        description=(
            "Instances register (role, address, model, capacity) under a TTL lease, heartbeat "
            "their load, and watch joins/updates/leaves over gRPC (pdserve.v1.MetaService). The "
            "same process serves Mooncake's HTTP metadata protocol at "
            "http://HOST:HTTP_PORT/metadata. Backends: memory (embedded; clients re-register "
            "after a restart) or etcd (state survives restarts)."
        ),
    )
