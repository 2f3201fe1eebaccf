"""``pdserve bench``: benchmarks against real service processes."""

from __future__ import annotations

import argparse


def _kvstore(args: argparse.Namespace) -> int:
    from pdserve.bench.kvstore import run

    return run(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks", description="Benchmarks that start real pdserve processes."
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="<benchmark>")
    kv = sub.add_parser(
        "kvstore",
        help="KV store data plane: put/get GB/s and latency per transport vs memcpy and Mooncake",
        description=(
            "Starts a KV store master and a storage node, then measures from this process put "
            "and get GB/s and p50/p99 latency per transport (shm, tcp, mooncake) and object "
            "size, numpy memcpy as the local limit, Mooncake Store's own client when Mooncake is "
            "installed, and longest_prefix over 64 keys."
        ),
    )
    from pdserve.bench.kvstore import add_arguments

    add_arguments(kv)
    kv.set_defaults(func=_kvstore)
    bench.set_defaults(func=lambda _args: bench.print_help() or 2)
