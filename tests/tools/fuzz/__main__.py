"""``python -m tests.tools.fuzz`` (from the repository root): every surface, or the ones
``--surfaces`` names, fuzzed against real processes; a table and the failures; exit 0 when
every invariant held."""

from __future__ import annotations

import argparse
import sys

from .runner import SURFACES, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.tools.fuzz",
        description=(
            "Starts a KV store, torch prefill and decode workers (tiny model), a router and a "
            "meta, and sends each surface --cases generated requests: valid ones with one "
            "hostile field, hostile everywhere, raw malformed bytes. Every answer must keep "
            "the invariants: no crash or hang, no INTERNAL/UNKNOWN/UNAVAILABLE or 5xx for bad "
            "input, and an INVALID_ARGUMENT that names the field. Needs hypothesis (the test "
            "extra)."
        ),
    )
    parser.add_argument(
        "--cases", type=int, default=10_000, help="generated cases per surface (default: 10000)"
    )
    parser.add_argument(
        "--surfaces", default=",".join(SURFACES), help="comma-separated surfaces (default: all)"
    )
    parser.add_argument("--log-dir", metavar="DIR", help="service logs (default: a temp dir)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
