"""``pdserve bench``: benchmarks against real service processes."""

from __future__ import annotations

import argparse

from pdserve.bench import ttft  # stdlib imports only (vLLM loads in its engine processes)

KV_DEFAULT_SIZES = "4KiB,1MiB,16MiB,64MiB"


def _kvstore(args: argparse.Namespace) -> int:
    from pdserve.bench.kvstore.run import run

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
            "size, one object per call and in batches (one prompt's chunks per call), numpy "
            "memcpy as the local limit, plain loopback tcp with the same socket settings as the "
            "tcp limit (tcp-plain: each get a distinct region of a large buffer, cold as a "
            "stored object, single and batched; tcp-plain-warm: one buffer sent again and "
            "again, cache-warm, for comparison only), with --disk-dir the raw disk limit "
            "(disk-raw, disk-raw-direct), Mooncake Store's own client when Mooncake is "
            "installed, longest_prefix over 64 keys (with the found keys' locations, as a "
            "connector asks, and the length alone), and one master round trip over gRPC and "
            "over the control wire. With Mooncake Store measured, a 'ceiling' line per size "
            "says how far ahead of it a tcp get can be in this run (tcp-plain over Mooncake "
            "Store), and after the rounds a side-by-side run gets from tcp-plain, pdserve "
            "tcp+lookup and Mooncake Store in turn, so that their ratios and that ceiling "
            "hold for the same conditions. Run it on a quiet machine: the figures are "
            "wall-clock."
        ),
    )
    _kvstore_arguments(kv)
    kv.set_defaults(func=_kvstore)
    tt = sub.add_parser(
        "ttft",
        help="vLLM first-token time, cold vs fully cached in the KV store (fresh engine)",
        description=(
            "Starts a KV store (master + node) and two vLLM engine processes one after the "
            "other: the first computes a random prompt cold and stores its chunks, the second "
            "(vLLM's local prefix cache reset before each timed request) loads them from the "
            "store. Prints both first-token times, their ratio and the loaded/computed tokens."
        ),
    )
    ttft.add_arguments(tt)
    tt.set_defaults(func=ttft.run)
    from pdserve.bench import kvcompress  # stdlib imports only; the rest loads when it runs

    kc = sub.add_parser(
        "kvcompress",
        help="KV chunk compression (none/bf16/fp8): bytes per chunk, cached TTFT, output drift",
        description=kvcompress.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kvcompress.add_arguments(kc)
    kc.set_defaults(func=kvcompress.run)
    mb = sub.add_parser(
        "meta",
        help="meta registry ops/s (register + heartbeat) and watch latency",
        description=(
            "Starts a meta process (memory backend, or etcd against --etcd-endpoints) and "
            "measures registry operations per second from concurrent clients and the time "
            "from a Register to a watcher seeing the JOINED event."
        ),
    )
    meta_arguments(mb)
    mb.set_defaults(func=_meta)
    from pdserve.bench import serve  # stdlib imports only; the rest loads when it runs
    from pdserve.bench.serve.cli import add_arguments as serve_arguments

    sv = sub.add_parser(
        "serve",
        help="online serving benchmark like 'vllm bench serve' (optionally vs colocated vLLM)",
        description=serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_arguments(sv)
    from pdserve.bench import chaos  # stdlib imports only

    ch = sub.add_parser(
        "chaos",
        help="faults under load: kill/stop each service in turn, count wrong/hung/lost",
        description=chaos.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chaos.add_arguments(ch)
    ch.set_defaults(func=chaos.run)
    from pdserve.bench import soak  # stdlib imports only

    so = sub.add_parser(
        "soak",
        help="steady mixed load for N minutes: RSS, fds, threads and /dev/shm must not grow",
        description=soak.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    soak.add_arguments(so)
    so.set_defaults(func=soak.run)
    from pdserve.bench import idle_conns  # stdlib imports only; gRPC loads when it runs

    ic = sub.add_parser(
        "idle-conns",
        help="a flood of idle connections on a port: is a real client still served, how fast",
        description=idle_conns.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    idle_conns.add_arguments(ic)
    ic.set_defaults(func=idle_conns.run)
    bench.set_defaults(func=lambda _args: bench.print_help() or 2)


def meta_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve bench meta`` (kept here so ``--help`` imports no gRPC)."""
    parser.add_argument(
        "--backend", default="memory", choices=["memory", "etcd"], help="registry backend"
    )
    parser.add_argument(
        "--etcd-endpoints", default="127.0.0.1:2379", help="a running etcd (backend=etcd)"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the ops/s phase")
    parser.add_argument("--workers", type=int, default=16, help="concurrent clients")
    parser.add_argument("--watch-samples", type=int, default=200, help="registrations timed")


def _meta(args: argparse.Namespace) -> int:
    from pdserve.bench import meta

    return meta.run(args)


def _kvstore_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default=KV_DEFAULT_SIZES,
        help=f"object sizes, comma-separated (default: {KV_DEFAULT_SIZES})",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=200,
        help="operations per size and direction; big sizes use fewer (at most 512 MiB moved, "
        "at least 3) (default: 200)",
    )
    p.add_argument(
        "--transports",
        default="shm,tcp,mooncake",
        help="pdserve transports to measure (default: shm,tcp,mooncake)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="objects per call in the batched runs (one prompt's chunks); fewer for big "
        "objects, at most 256 MiB per batch; 1 = single-object runs only (default: 16)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure every system this many times, in turn, each store started afresh, and "
        "report each figure's median across the rounds (the JSON keeps every round); with "
        "Mooncake Store measured, a 'per round' line per size and mode gives pdserve "
        "tcp+lookup over Mooncake Store in each round, the spread the medians hide "
        "(default: 3)",
    )
    p.add_argument(
        "--no-mooncake-store", action="store_true", help="skip the Mooncake Store baseline"
    )
    p.add_argument(
        "--no-side-by-side",
        dest="side_by_side",
        action="store_false",
        help="skip the side-by-side run (on by default with Mooncake Store and tcp measured): "
        "after the rounds, tcp-plain, pdserve/tcp+lookup and Mooncake Store get in turn, one "
        "get of each, with every server up, single and batched per size; its 'side by side' "
        "lines give the ratios and the ceiling (tcp-plain / mooncake-store) in the same "
        "conditions, where the rounds measure each system at another moment",
    )
    p.add_argument(
        "--checksums",
        action="store_true",
        help="also measure tcp with the raw-object checksum every read verifies (pdserve/tcp+sum; "
        "the other pdserve rows store without it, as KV chunks are stored, their header "
        "carrying their own)",
    )
    p.add_argument(
        "--tokens-compare",
        action="store_true",
        help="also measure tcp against a second store whose master runs with data_tokens off "
        "(pdserve/tcp-notok): what the per-range data-plane grants cost",
    )
    p.add_argument(
        "--tls-compare",
        action="store_true",
        help="also measure tcp against a store with mutual TLS on the master's gRPC port and "
        "control wire (pdserve/tcp-tls), as `pdserve up` runs by default",
    )
    p.add_argument(
        "--disk-dir",
        metavar="DIR",
        help="also measure the raw disk limit in DIR (default: off): a file of distinct random "
        "objects written (fsynced) there and each object read once, as O_DIRECT preads "
        "(disk-raw-direct: the device, page cache bypassed; left out where the file system "
        "refuses O_DIRECT) and as buffered preads after POSIX_FADV_DONTNEED of the file "
        "(disk-raw: cold page cache, readahead on); put = the writes plus one fsync. And "
        "pdserve's disk tier there (pdserve/tcp-disk): a store whose node keeps a few objects in "
        "memory and the rest on a disk segment in DIR, each object read once with the page "
        "cache dropped, one by one and in batches of 16 after longest_prefix (as the "
        "connector reads); put = the put alone. The disk figures are read against the raw "
        "ones: give a directory on the disk that tier would use "
        "(e.g. the run dir), not /dev/shm or another tmpfs (warned: that measures memory). "
        "Needs room for the biggest size's objects (at most 512 MiB)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--plot", metavar="PNG", help="also draw get GB/s per size per system to PNG")
    p.add_argument("--log-dir", metavar="DIR", help="service logs (default: a temporary directory)")
