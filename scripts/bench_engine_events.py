"""What does pdserve's router buy plain ``vllm serve`` users? One workload, side by side on the
same cores, fresh engines for each system (empty prefix caches):

1. two plain engines (one per core) behind ``pdserve bench serve``'s round-robin proxy (what a
   round-robin gateway or Kubernetes Service gives);
2. the same engines behind ``pdserve router --decode http://A --decode http://B``, no store and
   no events: placement by load alone;
3. the same engines publishing vLLM's KV events (``--kv-events-config``) and the router
   following them (``--engine-kv-events``): placement by load and by what each engine's own
   prefix cache holds.

Every ``pdserve bench serve`` flag works (workload, rate, SLOs, ``--json``)::

    .venv/bin/python scripts/bench_engine_events.py --workload prefix-repetition \\
        --num-prefixes 16 --prefix-len 1024 --suffix-len 64 --output-len 32 \\
        --num-prompts 96 --request-rate 1.2 --goodput ttft:2000 tpot:200
"""

from __future__ import annotations

import json
import sys

from pdserve.bench.serve.baseline import started_colocated, started_engines
from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.harness import logs_dir
from pdserve.bench.serve.metrics import parse_goodput
from pdserve.bench.serve.report import format_comparison, format_result, write_json
from pdserve.bench.serve.run import bench_system, build_workload
from pdserve.procs import ServiceProcess, free_ports, service_args, start_service


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    slos = parse_goodput(args.goodput or [])
    requests = build_workload(args)
    results = []
    ports = free_ports(2 * args.baseline_engines)

    def events(i: int) -> list[str]:
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{ports[2 * i]}",
            "replay_endpoint": f"tcp://*:{ports[2 * i + 1]}",
        }
        return ["--kv-events-config", json.dumps(cfg)]

    with logs_dir(args.keep_logs) as work:
        with started_colocated(args, work / "proxy") as url:
            results.append(bench_system("round robin", url, requests, args, slos, False))
        print(format_result(results[-1]), flush=True)
        for name, with_events in (("router", False), ("router + engine KV events", True)):
            procs: list[ServiceProcess] = []
            run = work / name.replace(" ", "-").replace("+", "")
            per_engine = events if with_events else (lambda i: [])
            with started_engines(args, run, per_engine, procs) as bases:
                flags: dict[str, object] = {"decode": ",".join(bases)}
                if with_events:
                    flags["engine_kv_events"] = ",".join(
                        f"{b}=tcp://127.0.0.1:{ports[2 * i]}+tcp://127.0.0.1:{ports[2 * i + 1]}"
                        for i, b in enumerate(bases)
                    )
                router = start_service(
                    "router",
                    service_args(
                        "router", host="127.0.0.1", port=0, http_port=0, model=args.model, **flags
                    ),
                    run,
                )
                procs.append(router)
                results.append(bench_system(name, router.info["http"], requests, args, slos, True))
            print(format_result(results[-1]), flush=True)
    print(format_comparison(results[1], results[0]), flush=True)
    print(format_comparison(results[2], results[0]), flush=True)
    print(format_comparison(results[2], results[1]), flush=True)
    if args.json:
        write_json(args.json, args, requests, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
