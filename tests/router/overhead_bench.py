"""Router overhead per request: router wall time minus worker time (prefill worker_ms + the
decode worker's time to its last token), read plan, on the real-process cluster of
test_cluster.py. Prints p50/p99 and the client-side latency for scale.

    .venv/bin/python tests/router/overhead_bench.py [requests] [max_tokens]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_cluster import Cluster

from pdserve import grpcutil
from pdserve.model.prepare import build_tiny_model
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), build_tiny_model())
        try:
            client_ms = []
            with grpcutil.sync_channel(cluster.grpc) as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                for i in range(n + 10):
                    req = router_pb2.GenerateRequest(
                        prompt_token_ids=[(i * 31 + k) % 400 + 20 for k in range(40)],
                        sampling=common_pb2.SamplingParams(
                            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                        ),
                        request_id=f"bench-{i}",
                    )
                    t0 = time.perf_counter()
                    list(stub.GenerateStream(req, timeout=60))
                    if i >= 10:  # warm-up excluded
                        client_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.5)
            traces = cluster.traces()
            over = [
                traces[f"bench-{i}"]["overhead_ms"]
                for i in range(10, n + 10)
                if traces.get(f"bench-{i}", {}).get("plan") == "read"
            ]
        finally:
            cluster.close()
    print(f"requests: {len(over)} (read plan, 40-token prompts, {max_tokens} output tokens)")
    print(
        f"router overhead ms: p50 {pct(over, 0.5):.2f}  p99 {pct(over, 0.99):.2f}  "
        f"mean {statistics.mean(over):.2f}"
    )
    print(f"client latency ms:  p50 {pct(client_ms, 0.5):.2f}  p99 {pct(client_ms, 0.99):.2f}")


if __name__ == "__main__":
    main()
