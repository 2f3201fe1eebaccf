"""One ``pdserve bench kvstore`` run: the flags checked, then every system in turn for each
round, each store started afresh, and the medians printed and written."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.kvstore.disk import bench_disk_raw, fs_type, memory_backed
from pdserve.bench.kvstore.disk_tier import bench_disk_tier
from pdserve.bench.kvstore.limits import bench_memcpy, bench_tcp_limit
from pdserve.bench.kvstore.measure import (
    Row,
    batch_for,
    iterations_for,
    median_dicts,
    median_rows,
    progress,
)
from pdserve.bench.kvstore.mooncake_store import bench_mooncake
from pdserve.bench.kvstore.pdserve_store import bench_control, bench_longest_prefix, bench_pdserve
from pdserve.bench.kvstore.report import per_round, plot, render
from pdserve.bench.kvstore.side_by_side import bench_side_by_side
from pdserve.sizes import parse_size


def run(args: argparse.Namespace) -> int:
    from pdserve.store.mooncake_backend import available as mooncake_available

    sizes = [parse_size(s, what="--sizes") for s in args.sizes.split(",")]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(transports) - {"shm", "tcp", "mooncake"}
    if unknown:
        raise SystemExit(f"--transports: unknown {sorted(unknown)}; choose shm, tcp, mooncake")
    if args.batch < 1:
        raise SystemExit("--batch must be >= 1 (1 = no batched runs)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    have_mc = mooncake_available()
    if not have_mc:
        progress("mooncake is not installed: skipping the mooncake transport and Mooncake Store")
        transports = [t for t in transports if t != "mooncake"]
    disk_dir = getattr(args, "disk_dir", None)
    if disk_dir:
        Path(disk_dir).mkdir(parents=True, exist_ok=True)
        if memory_backed(disk_dir):
            progress(
                f"--disk-dir {disk_dir} is on {fs_type(disk_dir)} (memory): the disk-raw rows "
                "measure memory, not a disk; give a directory on the disk tier's disk"
            )
    n_max = max(iterations_for(s, args.iterations) for s in sizes)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-kvstore-"))
    progress(f"logs in {log_dir}; up to {n_max} iterations per size; {args.rounds} round(s)")
    rounds = []
    for i in range(args.rounds):
        progress(f"round {i + 1} of {args.rounds}")
        rounds.append(_round(args, sizes, transports, have_mc, log_dir / f"round-{i + 1}"))
    side = []
    if have_mc and not args.no_mooncake_store and "tcp" in transports and args.side_by_side:
        progress("side by side: tcp-plain, pdserve tcp+lookup and Mooncake Store, in turn")
        side = bench_side_by_side(sizes, args.iterations, args.batch, log_dir / "side-by-side")
    rows = median_rows([r[0] for r in rounds])
    prefix = median_dicts([r[1] for r in rounds])
    control = median_dicts([r[2] for r in rounds])
    print(render(rows, prefix, control))
    if len(rounds) > 1:
        for line in per_round([r[0] for r in rounds]):
            print(line)
    for s in side:
        print(s.line())
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [asdict(r) for r in rows],
                    "longest_prefix": prefix,
                    "control": control,
                    "side_by_side": [s.as_dict() for s in side],
                    **(
                        {"disk": {"dir": str(Path(disk_dir).resolve()), "fs": fs_type(disk_dir)}}
                        if disk_dir
                        else {}
                    ),
                    "rounds": [
                        {"rows": [asdict(r) for r in rr], "longest_prefix": p, "control": c}
                        for rr, p, c in rounds
                    ],
                },
                indent=2,
            )
        )
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}")
    return 0


def _round(
    args: argparse.Namespace,
    sizes: list[int],
    transports: list[str],
    have_mc: bool,
    log_dir: Path,
) -> tuple[list[Row], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Every system once, one after the other, each store started afresh: the rows, the
    longest-prefix figures and the control-path figures of one round."""
    from pdserve.procs import local_store

    # Room for every object of a size below the master's high watermark (95 %: past it the
    # oldest objects are evicted, and their gets would be misses).
    need = max(_bytes_per_size(s, args) for s in sizes)
    segment = max(64 << 20, int(need / 0.9) + (16 << 20))
    rows = bench_memcpy(sizes, args.iterations, args.batch)
    if "tcp" in transports:
        progress("plain loopback tcp")
        rows += bench_tcp_limit(sizes, args.iterations, batch=args.batch)
    if getattr(args, "disk_dir", None):
        progress(f"raw disk reads in {args.disk_dir}")
        rows += bench_disk_raw(args.disk_dir, sizes, args.iterations)
        progress(f"pdserve's disk tier in {args.disk_dir}")
        rows += bench_disk_tier(args.disk_dir, sizes, args.iterations, log_dir)
    prefix: dict[str, dict[str, float]] = {}
    served = ",".join(["shm", "tcp", *(["mooncake"] if "mooncake" in transports else [])])
    with local_store(log_dir, segment_size=segment, transports=served) as (master, _node):
        for t in transports:
            rows += bench_pdserve(master.info["grpc"], t, sizes, args.iterations, args.batch)
            if args.checksums and t == "tcp":
                rows += bench_pdserve(
                    master.info["grpc"], t, sizes, args.iterations, args.batch, checksums=True
                )
        progress("longest_prefix and the control path (pdserve)")
        prefix["pdserve"] = bench_longest_prefix(master.info["grpc"])
        prefix["pdserve, length only"] = bench_longest_prefix(master.info["grpc"], locations=False)
        control = bench_control(master.info["grpc"])
    if args.tokens_compare and "tcp" in transports:
        progress("pdserve tcp again, its master with data tokens off")
        with local_store(
            log_dir / "no-tokens",
            segment_size=segment,
            transports="tcp",
            master_flags={"data_tokens": False},
        ) as (master, _node):
            rows += bench_pdserve(
                master.info["grpc"], "tcp", sizes, args.iterations, args.batch, suffix="-notok"
            )
    if args.tls_compare and "tcp" in transports:
        progress("pdserve tcp again, mutual TLS on the master and its control wire")
        rows_tls, control_tls = _bench_tls(log_dir / "tls", segment, sizes, args)
        rows += rows_tls
        control |= {f"{path} + mutual TLS": c for path, c in control_tls.items()}
    if have_mc and not args.no_mooncake_store:
        # Mooncake evicts above 90 % use and frees removed objects lazily: give it room for
        # every object of the run (and at least 64 MiB: its setup fails on tiny segments).
        mc_segment = max(64 << 20, 2 * sum(_bytes_per_size(s, args) for s in sizes))
        mc_rows, mc_prefix = bench_mooncake(sizes, args.iterations, args.batch, log_dir, mc_segment)
        rows += mc_rows
        prefix["mooncake-store batch_is_exist"] = mc_prefix
    return rows, prefix, control


def _bench_tls(
    log_dir: Path, segment: int, sizes: list[int], args: argparse.Namespace
) -> tuple[list[Row], dict[str, float]]:
    """pdserve tcp (and one control round trip) against a store whose master and node run
    with mutual TLS, this process presenting a worker certificate."""
    from pdserve import identity
    from pdserve.commands import certs
    from pdserve.procs import local_store

    d = log_dir / "certs"
    certs.make(d, ["master:bench-master", "node:bench-node", "worker:bench"])

    def tls(name: str) -> dict[str, object]:
        return {"tls_ca": d / "ca.crt", "tls_cert": d / f"{name}.crt", "tls_key": d / f"{name}.key"}

    identity.configure_files(identity.TlsFiles.load(*(str(v) for v in tls("bench").values())))
    try:
        with local_store(
            log_dir,
            segment_size=segment,
            transports="tcp",
            node_id="bench-node",
            node_flags=tls("bench-node"),
            master_flags=tls("bench-master"),
        ) as (master, _node):
            rows = bench_pdserve(
                master.info["grpc"], "tcp", sizes, args.iterations, args.batch, suffix="-tls"
            )
            control = bench_control(master.info["grpc"])
    finally:
        identity.configure_files(None)
    return rows, control


def _bytes_per_size(size: int, args: argparse.Namespace) -> int:
    """Bytes stored at once while one size runs (single-mode objects plus the warm-up)."""
    single = size * (iterations_for(size, args.iterations) + 1)
    if args.batch <= 1:
        return single
    nb = batch_for(size, args.batch)
    return max(single, size * nb * (iterations_for(size * nb, args.iterations) + 1))
