"""The ``pdserve`` command line.

Each command group lives in its own module with an ``add_parser(subparsers)`` function that
registers it and sets ``func``; modules are imported only when present, so ``--help`` lists
exactly the commands that exist, and a command line imports only its command's module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from pdserve import __version__

#: Each command and the module that registers it, in the order ``--help`` lists them. A
#: command line that names one imports only its module: ``pdserve health`` (the lab's
#: healthchecks, every few seconds in every container) must not load torch and vLLM's
#: settings, which the other modules' imports do (measured: 10 s of a busy core per check).
COMMANDS = {
    "up": "pdserve.commands.up",
    "status": "pdserve.commands.status",
    "health": "pdserve.commands.status",
    "certs": "pdserve.commands.certs",
    "generate": "pdserve.generate",
    "router": "pdserve.services.router.cli",
    "prefill": "pdserve.services.prefill.cli",
    "decode": "pdserve.services.decode.cli",
    "kvstore": "pdserve.services.kvstore.cli",
    "mooncake": "pdserve.commands.mooncake",
    "etcd": "pdserve.commands.etcd",
    "meta": "pdserve.services.meta.cli",
    "model": "pdserve.model.cli",
    "bench": "pdserve.bench.cli",
    "vllm": "pdserve.commands.vllm",
    "lmcache": "pdserve.integrations.lmcache_url",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: with ``command`` (one of :data:`COMMANDS`) only that
    command's module is imported; else every module present (``--help`` lists them all)."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=(
            "Prefill/decode-disaggregated LLM serving over gRPC around a pooled KV store. "
            "Run 'pdserve <command> --help' for the options of each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    wanted = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in wanted:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
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
