"""Control-plane benchmark of a real ``pdserve kvstore master`` process (no payload bytes).

Measures, through gRPC from a blocking client (as the store client calls it):

* LongestPrefix over 64 keys (all hits and half hits): p50 / p99 latency;
* BatchPutStart + BatchPutEnd throughput (objects/s) at a given batch size, with and without
  ``--state-dir`` persistence.

Run: ``python -m pdserve.services.kvstore.master_bench [--queries 2000] [--puts 20000]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pdserve import procs
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc


def _heartbeat(stub, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        resp = stub.Heartbeat(pb.NodeHeartbeatRequest(node_id="bench-node", segment_ids=["seg"]))
        if resp.remount_required:
            return


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(queries: int, puts: int, batch: int, state_dir: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["kvstore", "master", "--port", "0", "--metrics-port", "-1"]
        if state_dir is not None:
            args += ["--state-dir", state_dir or str(Path(tmp) / "state")]
        proc = procs.start_service("bench-master", args, Path(tmp) / "logs", timeout=60)
        stop = threading.Event()
        try:
            ch = grpc.insecure_channel(proc.info["grpc"])
            stub = kvstore_pb2_grpc.KVMasterServiceStub(ch)
            stub.MountSegment(
                pb.MountSegmentRequest(
                    segment=pb.Segment(segment_id="seg", node_id="bench-node", size=1 << 40)
                )
            )
            beat = threading.Thread(target=_heartbeat, args=(stub, stop), daemon=True)
            beat.start()
            # Put throughput.
            keys = [f"bench/{i:08d}/{'x' * 48}" for i in range(puts)]
            t0 = time.perf_counter()
            for i in range(0, puts, batch):
                chunk = keys[i : i + batch]
                r = stub.BatchPutStart(
                    pb.BatchPutStartRequest(
                        client_id="bench",
                        items=[pb.PutStartItem(key=k, size=11_796_480) for k in chunk],
                    )
                )
                assert all(x.code == pb.KV_OK for x in r.results), r.results[0]
                e = stub.BatchPutEnd(pb.BatchKeysRequest(client_id="bench", keys=chunk))
                assert all(x.code == pb.KV_OK for x in e.results)
            put_s = time.perf_counter() - t0
            # LongestPrefix over 64 keys.
            hit = keys[:64]
            half = keys[:32] + [f"miss/{i}" for i in range(32)]
            out: dict[str, float] = {"puts_per_s": puts / put_s}
            for name, req_keys, expect in (("all_hit", hit, 64), ("half_hit", half, 32)):
                req = pb.LongestPrefixRequest(keys=req_keys)
                for _ in range(100):  # warm up
                    stub.LongestPrefix(req)
                lat = []
                for _ in range(queries):
                    t = time.perf_counter()
                    resp = stub.LongestPrefix(req)
                    lat.append((time.perf_counter() - t) * 1e3)
                    assert resp.length == expect
                out[f"lp64_{name}_p50_ms"] = statistics.median(lat)
                out[f"lp64_{name}_p99_ms"] = _pct(lat, 0.99)
            ch.close()
            return out
        finally:
            stop.set()
            proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=2000, help="LongestPrefix calls per case")
    ap.add_argument("--puts", type=int, default=20000, help="objects to put")
    ap.add_argument("--batch", type=int, default=64, help="keys per BatchPutStart/End")
    a = ap.parse_args()
    for label, state in (("in-memory", None), ("--state-dir (SQLite)", "")):
        res = run(a.queries, a.puts, a.batch, state)
        print(label, "  ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
