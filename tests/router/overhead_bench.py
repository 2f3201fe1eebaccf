"""Router overhead per request: router wall time minus worker time (prefill worker_ms + the
decode worker's time to its last token), read plan, on the real-process cluster of
cluster_harness.py. Prints p50/p99 and the client-side latency for scale; with ``--tls`` it
measures a plaintext cluster and then one with mutual TLS on every internal link, side by
side in one run.

    .venv/bin/python tests/router/overhead_bench.py [requests] [max_tokens] [--tls]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

# the cluster harness (tests/router) and the helpers it imports (tests/)
sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from cluster_harness import Cluster

from pdserve import grpcutil
from pdserve.model.prepare import build_tiny_model
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure(n: int, max_tokens: int, tls: bool) -> tuple[list[float], list[float]]:
    """(router overhead ms, client latency ms) of ``n`` requests after 10 warm-up ones."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), build_tiny_model(), tls=tls)
        try:
            client_ms = []
            with grpcutil.sync_channel(cluster.grpc, public=True) as ch:
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
    return over, client_ms


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--tls"]
    n = int(argv[0]) if argv else 200
    max_tokens = int(argv[1]) if len(argv) > 1 else 8
    modes = (False, True) if "--tls" in sys.argv else (False,)
    results = {tls: measure(n, max_tokens, tls) for tls in modes}
    print(f"requests: {n} (read plan, 40-token prompts, {max_tokens} output tokens)")
    for tls, (over, client_ms) in results.items():
        label = "mutual TLS" if tls else "plaintext"
        print(
            f"{label:>10}: router overhead ms p50 {pct(over, 0.5):.2f}  p99 {pct(over, 0.99):.2f}"
            f"  mean {statistics.mean(over):.2f} ({len(over)} read plans);  client latency ms "
            f"p50 {pct(client_ms, 0.5):.2f}  p99 {pct(client_ms, 0.99):.2f}"
        )


if __name__ == "__main__":
    main()
