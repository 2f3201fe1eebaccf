"""``pdserve mooncake master`` / ``pdserve mooncake storage``: a real Mooncake Store as two
pdserve-style services, so ``pdserve up --store-backend mooncake`` starts, supervises and stops
them like its other services (a READY line once serving, SIGTERM to stop, exit on failure).

``master`` runs the ``mooncake_master`` binary shipped in the mooncake wheel as its child (in
its own process group, so stopping the group leaves nothing behind), bound to ``--host``
(RPC and metrics), and exits when it exits. ``storage`` contributes ``--segment-size`` of memory
to the pool through a Mooncake client, the role a pdserve storage node plays.

Mooncake's own links (the master's RPC, the Transfer Engines' data and handshakes) carry no TLS
and no authentication: keep them on 127.0.0.1 (the default) or a network you trust.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading

#: mooncake_master's default read-lease TTL is 5 s; removals wait them out.
DEFAULT_LEASE_MS = 5000


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _master(args: argparse.Namespace) -> int:
    from pdserve.lifecycle import run_child
    from pdserve.store.mooncake_cluster import master_command

    metrics = args.metrics_port or _free_port(args.host)
    cmd = master_command(args.host, args.port, metrics, args.lease_ms)

    def listening() -> bool:
        try:
            socket.create_connection((args.host, args.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    return run_child(
        "mooncake-master",
        cmd,
        listening,
        args.ready_timeout_s,
        rpc=f"{args.host}:{args.port}",
        metrics=metrics,
    )


def _storage(args: argparse.Namespace) -> int:
    from pdserve import errors
    from pdserve.lifecycle import announce_ready
    from pdserve.sizes import parse_size
    from pdserve.store import open_store

    stop = _stop_event()
    segment = parse_size(args.segment_size, what="segment_size", minimum=0)
    try:
        store = open_store(
            args.master,
            backend="mooncake",
            segment_bytes=segment,
            host=args.host,
            metadata_server=args.metadata_server,
        )
    except errors.PdserveError as exc:
        print(f"pdserve mooncake storage: {exc}", file=sys.stderr)
        return 1
    announce_ready("mooncake-storage", master=args.master, segment_bytes=segment)
    stop.wait()
    store.close()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "mooncake",
        help="a real Mooncake Store as services: mooncake_master, a storage process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="mooncake_command", metavar="<command>", required=True)
    m = sub.add_parser("master", help="run mooncake_master (supervised, READY line)")
    m.add_argument("--host", default="127.0.0.1", help="address RPC and metrics bind to")
    m.add_argument("--port", type=int, default=50051, help="RPC port (default: 50051)")
    m.add_argument("--metrics-port", type=int, default=0, help="metrics port (0 = a free one)")
    m.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS, help="read-lease TTL (ms)")
    m.add_argument("--ready-timeout-s", type=float, default=30.0)
    m.set_defaults(func=_master)
    s = sub.add_parser("storage", help="contribute a memory segment to a Mooncake Store")
    s.add_argument("--master", required=True, help="mooncake_master address HOST:PORT")
    s.add_argument("--segment-size", default="1GiB", help="memory contributed (e.g. 2GiB)")
    s.add_argument("--host", default="127.0.0.1", help="address its Transfer Engine binds to")
    s.add_argument(
        "--metadata-server",
        default="P2PHANDSHAKE",
        help="Transfer Engine metadata server: P2PHANDSHAKE or http://HOST:PORT/metadata ...",
    )
    s.set_defaults(func=_storage)
