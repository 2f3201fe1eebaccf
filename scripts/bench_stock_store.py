"""Does pdserve's store pay for stock vLLM users? One workload, side by side on the same cores:
two plain ``vllm serve`` engines (one per core) behind ``pdserve bench serve``'s round-robin
proxy, then the same two engines with pdserve's connector and a pdserve KV store
(docs/vllm-connector.md). Every ``pdserve bench serve`` flag works (workload, rate, SLOs,
``--baseline-kv-cache-gib``, ``--json``)::

    .venv/bin/python scripts/bench_stock_store.py --workload prefix-repetition \
        --num-prefixes 16 --prefix-len 1024 --suffix-len 64 --output-len 32 \
        --num-prompts 96 --request-rate 1.2 --goodput ttft:2000 tpot:200
"""

from __future__ import annotations

import json
import sys

from pdserve.bench.serve.baseline import started_colocated
from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.harness import logs_dir
from pdserve.bench.serve.metrics import parse_goodput
from pdserve.bench.serve.report import format_comparison, format_result, write_json
from pdserve.bench.serve.run import bench_system, build_workload
from pdserve.procs import local_store


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    parser.add_argument("--store-segment", default="2GiB", help="the store node's memory")
    args = parser.parse_args(argv)
    slos = parse_goodput(args.goodput or [])
    requests = build_workload(args)
    results = []
    base_flags = args.baseline_args
    with logs_dir(args.keep_logs) as work:
        args.baseline_args = base_flags
        with started_colocated(args, work / "plain") as url:
            results.append(bench_system("stock vLLM", url, requests, args, slos, False))
        print(format_result(results[-1]), flush=True)
        with local_store(work / "store", segment_size=args.store_segment) as (master, _node):
            transfer = {
                "kv_connector": "PdserveConnector",
                "kv_connector_module_path": "pdserve.engines.vllm_connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"master_address": master.info["grpc"]},
            }
            args.baseline_args = f"{base_flags} --kv-transfer-config '{json.dumps(transfer)}'"
            with started_colocated(args, work / "store") as url:
                results.append(
                    bench_system("vLLM + pdserve store", url, requests, args, slos, False)
                )
        print(format_result(results[-1]), flush=True)
    print(format_comparison(results[1], results[0]), flush=True)
    if args.json:
        write_json(args.json, args, requests, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
