"""``pdserve decode``: run a decode worker."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve import config
    from pdserve.services.decode.config import DecodeConfig

    parser = sub.add_parser(
        "decode",
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
    config.add_arguments(parser, DecodeConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve import config, lifecycle, telemetry
    from pdserve.services.decode.config import DecodeConfig
    from pdserve.services.decode.server import serve

    cfg = config.from_args(DecodeConfig, "decode", args)
    telemetry.setup_logging("decode", cfg.log_level)
    return lifecycle.run(lambda stop: serve(cfg, stop))
