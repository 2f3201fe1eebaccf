"""Meta registry benchmark: registry ops/s (register + heartbeat with load) and watch latency
(Register sent -> watcher receives JOINED), against a real ``pdserve meta`` process.

    pdserve bench meta --backend memory
    pdserve bench meta --backend etcd --etcd-endpoints 127.0.0.1:2379

(its flags are :func:`pdserve.bench.cli.meta_arguments`, which imports no gRPC).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pdserve import grpcutil
from pdserve.procs import start_service
from pdserve.v1 import common_pb2, meta_pb2, meta_pb2_grpc


def _inst(iid: str) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=iid, role=common_pb2.ROLE_DECODE, address="127.0.0.1:9000", model="m"
    )


async def _ops(stub: meta_pb2_grpc.MetaServiceStub, seconds: float, workers: int) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        lease = (
            await stub.Register(meta_pb2.RegisterRequest(instance=_inst(f"w{w}"), ttl_ms=10_000))
        ).lease_id
        i = 0
        while time.perf_counter() < end:
            if i % 2:
                load = common_pb2.Load(queue_length=i % 7, running_requests=i % 5, kv_usage=0.5)
                await stub.Heartbeat(meta_pb2.MetaHeartbeatRequest(lease_id=lease, load=load))
            else:
                r = await stub.Register(
                    meta_pb2.RegisterRequest(instance=_inst(f"w{w}"), ttl_ms=10_000)
                )
                lease = r.lease_id
            i += 1
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return done / (time.perf_counter() - t0)


async def _watch_latency(stub: meta_pb2_grpc.MetaServiceStub, n: int) -> list[float]:
    call = stub.WatchInstances(meta_pb2.WatchInstancesRequest(role=common_pb2.ROLE_PREFILL))
    await call.initial_metadata()
    lat = []
    for k in range(n):
        inst = meta_pb2.Instance(
            instance_id=f"lat{k}", role=common_pb2.ROLE_PREFILL, address="127.0.0.1:1", model="m"
        )
        t0 = time.perf_counter()
        await stub.Register(meta_pb2.RegisterRequest(instance=inst, ttl_ms=10_000))
        while (await call.read()).instance.instance_id != f"lat{k}":
            pass
        lat.append((time.perf_counter() - t0) * 1000)
    call.cancel()
    return lat


async def _main(args: argparse.Namespace, address: str) -> None:
    async with grpcutil.channel(address, role="meta") as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        ops = await _ops(stub, args.seconds, args.workers)
        lat = sorted(await _watch_latency(stub, args.watch_samples))
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(
        f"backend={args.backend} workers={args.workers}: {ops:.0f} registry ops/s "
        f"(register+heartbeat); watch latency p50 {statistics.median(lat):.2f} ms, "
        f"p99 {p99:.2f} ms over {len(lat)} registrations"
    )


def run(args: argparse.Namespace) -> int:
    cli = ["meta", "--port", "0", "--http-port", "-1", "--backend", args.backend]
    if args.backend == "etcd":
        cli += ["--etcd-endpoints", args.etcd_endpoints]
    meta = start_service("meta-bench", cli, Path(tempfile.mkdtemp(prefix="pdserve-bench-")))
    try:
        asyncio.run(_main(args, meta.info["grpc"]))
    finally:
        meta.stop()
    return 0
