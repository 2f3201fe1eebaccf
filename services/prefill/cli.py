"""``pdserve prefill``: run a prefill worker."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve import config
    from pdserve.services.prefill.config import PrefillConfig

    parser = sub.add_parser(
        "prefill",
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
    config.add_arguments(parser, PrefillConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve import config, lifecycle, telemetry
    from pdserve.services.prefill.config import PrefillConfig
    from pdserve.services.prefill.server import serve

    cfg = config.from_args(PrefillConfig, "prefill", args)
    telemetry.setup_logging("prefill", cfg.log_level)
    return lifecycle.run(lambda stop: serve(cfg, stop))
