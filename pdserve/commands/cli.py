"""The ``pdserve`` command line.

Each command group lives in its own module with an ``add_parser(subparsers)`` function that
registers it and sets ``func``; modules are imported only when present, so ``--help`` lists
exactly the commands that exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from pdserve import __version__

#: Modules that contribute subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = [
    "pdserve.commands.up",
    "pdserve.commands.status",
    "pdserve.commands.certs",
    "pdserve.generate",
    "pdserve.services.router.cli",
    "pdserve.services.prefill.cli",
    "pdserve.services.decode.cli",
    "pdserve.services.kvstore.cli",
    "pdserve.commands.mooncake",
    "pdserve.commands.etcd",
    "pdserve.services.meta.cli",
    "pdserve.model.cli",
    "pdserve.bench.cli",
    "pdserve.commands.vllm",
    "pdserve.integrations.lmcache_url",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=(
            "Prefill/decode-disaggregated LLM serving over gRPC around a pooled KV store. "
            "Run 'pdserve <command> --help' for the options of each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMAND_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from pdserve import identity

    try:
        # Client commands (status, generate, bench) dial mutual-TLS services with the files in
        # PDSERVE_TLS_CA / _CERT / _KEY; a service replaces them with its own config's.
        identity.configure_env()
    except ValueError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
