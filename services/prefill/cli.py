"""``pdserve prefill``: run a prefill worker."""

from __future__ import annotations

import argparse

from pdserve.commands.service import add_service_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.services.prefill.config import PrefillConfig

    add_service_command(
        subparsers,
        "prefill",
        config_cls=PrefillConfig,
        section="prefill",
        serve="pdserve.services.prefill.server:serve",
        help="prefill worker: runs prompts, loads/writes KV chunks in the store, returns the first token",
        description=(
            "Runs prompts through the engine (torch or vllm). Loads the longest cached prefix "
            "of full KV chunks from the store, computes the rest, writes new full chunks under "
            "their prefix-hash keys (skipping existing ones) and the partial tail under a "
            "request-scoped key with a TTL, and returns the first token, the keys and the "
            "cached-token count (pdserve.v1.PrefillService). Registers with meta "
            "(--meta) and reports live load; serves /metrics."
        ),
    )
