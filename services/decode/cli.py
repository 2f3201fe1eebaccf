"""``pdserve decode``: run a decode worker."""

from __future__ import annotations

import argparse

from pdserve.commands.service import add_service_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.decode.config import DecodeConfig

    add_service_command(
        subparsers,
        "decode",
        config_cls=DecodeConfig,
        section="decode",
        serve="pdserve.services.decode.server:serve",
        help="decode worker: loads a request's KV from the store (or prefills locally) and streams tokens",
        description=(
            "Streams tokens for a request (pdserve.v1.DecodeService): fetches its KV chunks "
            "from the store by handle and verifies them (a missing or corrupt chunk is "
            "recomputed, never a wrong token), or prefills locally when no handle is given. "
            "Honours max_tokens, EOS, stop strings, temperature/top-p/top-k/seed, client "
            "cancellation and deadlines. Registers with meta (--meta) and reports live load; "
            "serves /metrics."
        ),
    )
