"""``pdserve etcd``: one etcd member as a pdserve-style service, so ``pdserve up
--kvstore-masters N`` starts, supervises and stops the etcd its masters elect a leader through
like its other services (a READY line once etcd answers /health, SIGTERM to stop, exit when
etcd exits).

It runs the ``etcd`` binary (from PATH, else /usr/bin/etcd: ``apt-get install etcd-server``)
as its child, in its process group, a single-member cluster with client and peer URLs on
``--host`` and a data dir that later runs reuse. With ``--tls-ca``, ``--tls-cert`` and
``--tls-key`` both links are TLS and take only clients (and peers) with a certificate of that
CA (``--client-cert-auth``): ``pdserve up`` gives it a CA of its own whose only other
certificate is the KV masters', so no other service, and no one else, reaches it. Without
them its links carry no TLS and no authentication: keep it on 127.0.0.1 (the default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import urllib.request

#: What to install when the binary is missing.
MISSING = "no etcd binary on PATH or at /usr/bin/etcd: apt-get install etcd-server"


def binary() -> str | None:
    """The etcd binary: on PATH, else /usr/bin/etcd; None when neither exists."""
    found = shutil.which("etcd") or "/usr/bin/etcd"
    return found if os.access(found, os.X_OK) else None


def command(
    exe: str, data_dir: str, host: str, port: int, peer_port: int, tls: tuple[str, ...] = ()
) -> list[str]:
    """A single-member etcd: clients on ``host:port``, peers on ``host:peer_port``, old
    revisions compacted every hour (leader leases and objects churn). ``tls``: (CA,
    certificate, key) paths: both links TLS, a certificate of the CA required of clients and
    peers."""
    scheme = "https" if tls else "http"
    client, peer = f"{scheme}://{host}:{port}", f"{scheme}://{host}:{peer_port}"
    cmd = [
        exe,
        "--name=pdserve",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=pdserve={peer}",
        "--auto-compaction-retention=1",
    ]
    if tls:
        ca, cert, key = tls
        for side in ("", "peer-"):
            cmd += [f"--{side}cert-file={cert}", f"--{side}key-file={key}"]
            cmd += [f"--{side}trusted-ca-file={ca}", f"--{side}client-cert-auth"]
    return cmd


def healthy(address: str, tls: tuple[str, ...] = ()) -> bool:
    """Whether the etcd member at ``address`` (host:port) answers /health with true (over
    TLS, presenting ``tls``' certificate, when given)."""
    ctx = None
    if tls:
        import ssl

        ctx = ssl.create_default_context(cafile=tls[0])
        ctx.load_cert_chain(tls[1], tls[2])
    scheme = "https" if tls else "http"
    try:
        with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=1, context=ctx) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def _run(args: argparse.Namespace) -> int:
    from pdserve.lifecycle import run_child

    exe = binary()
    if exe is None:
        print(f"pdserve etcd: {MISSING}", file=sys.stderr)
        return 1
    tls = (args.tls_ca, args.tls_cert, args.tls_key)
    if any(tls) and not all(tls):
        print("pdserve etcd: TLS needs --tls-ca, --tls-cert and --tls-key", file=sys.stderr)
        return 2
    tls = tls if all(tls) else ()
    os.makedirs(args.data_dir, mode=0o700, exist_ok=True)
    address = f"{args.host}:{args.port}"
    cmd = command(exe, args.data_dir, args.host, args.port, args.peer_port, tls)
    return run_child(
        "etcd", cmd, lambda: healthy(address, tls), args.ready_timeout_s, client=address
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "etcd",
        help="run one etcd member (supervised, READY line): what up's KV masters elect through",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data-dir", required=True, help="etcd's data directory (kept across runs)")
    p.add_argument("--host", default="127.0.0.1", help="address client and peer URLs bind to")
    p.add_argument("--port", type=int, default=2379, help="client port (default: %(default)s)")
    p.add_argument("--peer-port", type=int, default=2380, help="peer port (default: %(default)s)")
    p.add_argument("--ready-timeout-s", type=float, default=30.0)
    p.add_argument("--tls-ca", default="", help="CA (PEM) clients' and peers' certificates need")
    p.add_argument("--tls-cert", default="", help="etcd's certificate (PEM)")
    p.add_argument("--tls-key", default="", help="its private key (PEM)")
    p.set_defaults(func=_run)
