"""``pdserve router``: the public entry point (gRPC RouterService + OpenAI HTTP API)."""

from __future__ import annotations

import argparse

from pdserve.commands.service import add_service_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.router.config import RouterConfig

    add_service_command(
        subparsers,
        "router",
        config_cls=RouterConfig,
        section="router",
        serve="pdserve.services.router.server:serve",
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
