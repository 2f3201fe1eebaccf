"""``pdserve meta``: run the service registry (gRPC) and the Mooncake HTTP metadata endpoint."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve import config
    from pdserve.services.meta.server import MetaConfig

    parser = sub.add_parser(
        "meta",
        help="service registry with TTL leases and watches; Mooncake HTTP metadata server",
        description=(
            "Instances register (role, address, model, capacity) under a TTL lease, heartbeat "
            "their load, and watch joins/updates/leaves over gRPC (pdserve.v1.MetaService). The "
            "same process serves Mooncake's HTTP metadata protocol at "
            "http://HOST:HTTP_PORT/metadata. Backends: memory (embedded; clients re-register "
            "after a restart) or etcd (state survives restarts)."
        ),
    )
    config.add_arguments(parser, MetaConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve import config, lifecycle, telemetry
    from pdserve.services.meta.server import MetaConfig, serve

    cfg = config.from_args(MetaConfig, "meta", args)
    telemetry.setup_logging("meta", cfg.log_level)
    return lifecycle.run(lambda stop: serve(cfg, stop))
