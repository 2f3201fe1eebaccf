"""``pdserve router``: the public entry point (gRPC RouterService + OpenAI HTTP API)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve import config
    from pdserve.services.router.config import RouterConfig

    parser = sub.add_parser(
        "router",
        help="public entry: gRPC Generate/GenerateStream and an OpenAI-compatible HTTP API",
        description=(
            "Tokenizes requests, asks the KV store how much of the prompt is cached, picks a "
            "prefill worker (policy) and a decode worker (load, free KV), and orchestrates them "
            "in read, write or colocated mode, with retries, a circuit breaker and admission "
            "control. Workers come from meta (--meta) or static lists (--prefill/--decode). "
            "The HTTP port serves /v1/completions, /v1/chat/completions, /v1/models, /health "
            "and /metrics."
        ),
    )
    config.add_arguments(parser, RouterConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve import config, lifecycle, telemetry
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.server import serve

    cfg = config.from_args(RouterConfig, "router", args)
    telemetry.setup_logging("router", cfg.log_level)
    return lifecycle.run(lambda stop: serve(cfg, stop))
