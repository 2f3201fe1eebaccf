"""Flags of ``pdserve bench serve`` and its ``gen-trace`` subcommand, and the command's exit
codes (:func:`run_cli`). Imports only the standard library; the benchmark loads when it runs."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time

from pdserve.bench.serve.baseline import BASELINES, BOTH, baseline_vllm_flags
from pdserve.bench.serve.gentrace import add_gen_trace_command
from pdserve.bench.serve.history import add_history_arguments
from pdserve.bench.serve.memory import add_memory_arguments
from pdserve.bench.serve.status import BenchError, say
from pdserve.bench.serve.vllm_router import add_router_arguments

DEFAULT_TARGET = "http://127.0.0.1:8000"
WORKLOADS = ("random", "prefix-repetition", "multi-round", "long-prefill", "trace")


def _workload(text: str) -> str:
    """A workload name; vLLM's ``--dataset-name`` spellings (``prefix_repetition``) too."""
    return text.replace("_", "-")


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive (or inf)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve bench serve`` (and its ``gen-trace`` subcommand)."""
    d = "(default: %(default)s)"
    # NOTE: abbreviations would let this parser claim gen-trace's --out as --output-len.
    parser.allow_abbrev = False
    sysg = parser.add_argument_group("systems")
    sysg.add_argument(
        "--target",
        "--base-url",
        default=DEFAULT_TARGET,
        help=f"OpenAI-compatible base URL of the system under test, e.g. a running 'pdserve up' {d}",
    )
    sysg.add_argument(
        "--api-key",
        default="",
        help="the target's API key, sent as 'Authorization: Bearer KEY' (default: "
        "$PDSERVE_API_KEY, which unlike a flag does not show in ps; --start-pdserve reads the "
        "key from its run dir)",
    )
    sysg.add_argument("--model", default="smollm2", help=f"model name sent in requests {d}")
    sysg.add_argument(
        "--label", default="pdserve", help=f"name of the system under test in the output {d}"
    )
    sysg.add_argument(
        "--start-pdserve",
        metavar="ARGS",
        help="start 'pdserve up ARGS' on free ports for the run and stop it after (replaces "
        "--target; --model is passed to it unless ARGS has --model; do not pass ports or "
        "--run-dir) (default: use --target)",
    )
    sysg.add_argument(
        "--compare",
        choices=["none", *BASELINES, BOTH],
        default="none",
        help="also run the workload against a colocated vLLM baseline: two 'vllm serve' "
        "engines, one per core (VLLM_CPU_OMP_THREADS_BIND=0/1, VLLM_CPU_KVCACHE_SPACE), behind "
        "a round-robin proxy (colocated) or vLLM's own router, vllm-router, prefix-aware "
        "(colocated-router), or both in turn (both: the report compares the system under test "
        f"with each and with the better), started after the system under test is done {d}",
    )
    sysg.add_argument(
        "--baseline-engines", type=int, default=2, help=f"colocated vLLM engines, one per core {d}"
    )
    sysg.add_argument(
        "--baseline-kv-cache-gib",
        type=float,
        help="VLLM_CPU_KVCACHE_SPACE of each baseline engine (default: --engine-kv-cache-gib, "
        "else 2)",
    )
    add_memory_arguments(sysg)
    sysg.add_argument(
        "--baseline-pin",
        action="store_true",
        help="pin each baseline engine's whole process tree to its core (as `taskset -c N "
        "vllm serve`), as pdserve pins its workers; default: only vLLM's OpenMP threads "
        "(VLLM_CPU_OMP_THREADS_BIND), vLLM's documented setting",
    )
    sysg.add_argument(
        "--baseline-args",
        default=baseline_vllm_flags(),
        metavar="ARGS",
        help="flags of each baseline 'vllm serve'; --dtype is the one pdserve's vLLM workers "
        f"pick on this machine (float32 on CPUs without native bfloat16) {d}",
    )
    add_router_arguments(sysg)
    sysg.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help=f"seconds a started system may take to become ready {d}",
    )
    sysg.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the logs of started systems (a temporary folder, printed) even on success",
    )

    wl = parser.add_argument_group("workload")
    wl.add_argument(
        "--workload",
        "--dataset-name",
        type=_workload,
        choices=WORKLOADS,
        default="random",
        help=f"workload kind {d}",
    )
    wl.add_argument("--seed", type=int, default=0, help=f"seed of every random choice {d}")
    wl.add_argument(
        "--vocab-size",
        type=int,
        help="token ids are drawn from [100, vocab size) (default: the model folder's "
        "config.json vocab_size when it is prepared here, else 49152)",
    )
    wl.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrival rate in requests/s of random, prefix-repetition and "
        "long-prefill workloads, "
        f"conversation starts/s of multi-round; inf sends everything at once {d}",
    )
    wl.add_argument(
        "--num-prompts", type=int, default=100, help=f"requests (random, prefix, long-prefill) {d}"
    )
    wl.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=256,
        help=f"random: prompt tokens; long-prefill: each decode stream's prompt tokens {d}",
    )
    wl.add_argument(
        "--output-len",
        "--random-output-len",
        "--prefix-repetition-output-len",
        type=int,
        default=16,
        help="random, prefix-repetition, multi-round: max_tokens (ignore_eos); long-prefill: "
        f"the long prompts' {d}",
    )
    wl.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help=f"random: lengths uniform in [len*(1-r), len*(1+r)] {d}",
    )
    for flag, vllm_flag, default, what in (
        ("--num-prefixes", "--prefix-repetition-num-prefixes", 4, "prefixes"),
        ("--prefix-len", "--prefix-repetition-prefix-len", 256, "prefix tokens"),
        ("--suffix-len", "--prefix-repetition-suffix-len", 32, "suffix tokens"),
    ):
        wl.add_argument(
            flag, vllm_flag, type=int, default=default, help=f"prefix-repetition: {what} {d}"
        )
    wl.add_argument(
        "--num-conversations", type=int, default=8, help=f"multi-round: conversations {d}"
    )
    wl.add_argument("--rounds", type=int, default=4, help=f"multi-round: rounds each {d}")
    wl.add_argument(
        "--turn-len", type=int, default=64, help=f"multi-round: new user tokens per round {d}"
    )
    wl.add_argument(
        "--long-fraction",
        type=float,
        default=0.25,
        help=f"long-prefill: share of the requests that are long prompts {d}",
    )
    wl.add_argument(
        "--long-len-min", type=int, default=1024, help=f"long-prefill: shortest long prompt {d}"
    )
    wl.add_argument(
        "--long-len-max",
        type=int,
        default=3840,
        help=f"long-prefill: longest long prompt (the baseline's context is 4,096) {d}",
    )
    wl.add_argument(
        "--stream-output-len",
        type=int,
        default=256,
        help=f"long-prefill: max_tokens of each decode stream {d}",
    )
    wl.add_argument("--trace", metavar="FILE", help="trace: Mooncake JSONL trace to replay")
    wl.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="trace: tokens per hash block (the trace's are 512; input lengths scale by "
        f"N/512) {d}",
    )
    wl.add_argument(
        "--time-scale", type=float, default=1.0, help=f"trace: multiply arrival times by X {d}"
    )
    wl.add_argument(
        "--output-scale",
        type=float,
        help="trace: multiply output lengths by X (default: block-tokens/512, as the input)",
    )
    wl.add_argument("--min-output", type=int, default=1, help=f"trace: clamp max_tokens below {d}")
    wl.add_argument(
        "--max-output", type=int, default=0, help=f"trace: clamp max_tokens above (0 = none) {d}"
    )
    wl.add_argument("--max-rows", type=int, default=0, help=f"trace: first N rows (0 = all) {d}")
    add_history_arguments(parser)

    run = parser.add_argument_group("run and output")
    run.add_argument(
        "--max-concurrency",
        type=int,
        help="most requests in flight; later arrivals wait for a slot (default: unlimited)",
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured requests before each run, one after the other (random prompts of the "
        "first request's length, so no workload prefix gets cached; 2 reach both engines of "
        f"the round-robin baseline) {d}",
    )
    run.add_argument(
        "--request-timeout", type=float, default=600.0, help=f"seconds per request {d}"
    )
    run.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 [e2el:3000]: completed requests/s that "
        "meet all of them (default: no goodput)",
    )
    run.add_argument("--json", metavar="FILE", help="write every number and per-request record")
    run.add_argument(
        "--save-result",
        action="store_true",
        help="as vllm bench serve: write the JSON of --json to --result-dir/--result-filename",
    )
    run.add_argument("--result-dir", metavar="DIR", help="--save-result's folder (default: .)")
    run.add_argument(
        "--result-filename",
        metavar="NAME",
        help="--save-result's file name (default: pdserve-<workload>-<time>.json)",
    )
    run.add_argument(
        "--plot-dir",
        metavar="DIR",
        help="write ttft_cdf.png, tpot_cdf.png, throughput.png and inflight.png",
    )
    run.add_argument(
        "--window-s", type=float, default=5.0, help=f"throughput plot window in seconds {d}"
    )
    run.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_capacity_arguments(parser)
    parser.set_defaults(func=run_cli)

    add_gen_trace_command(parser)


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    cap = parser.add_argument_group("capacity")
    cap.add_argument(
        "--find-capacity",
        action="store_true",
        help="instead of one run, search each system (started once) for the highest rate at "
        "which --attainment of all requests meet every --goodput SLO (needs ttft:MS); "
        "with --compare colocated the baseline is searched first and the system under test "
        "is also run at the baseline's capacity; --json and --plot-dir then write the "
        "search (capacity.png)",
    )
    cap.add_argument(
        "--attainment",
        type=float,
        metavar="FRAC",
        default=0.9,
        help="share of all requests that must meet every SLO (failed ones miss); a system "
        "whose bound at any rate (requests arriving together share one TTFT window) is under "
        f"it is not searched: no rate can reach it {d}",
    )
    cap.add_argument(
        "--rate-start",
        type=_rate,
        metavar="REQ_S",
        help="first rate tried in req/s (conversations/s for multi-round) (default: a "
        "trace's own rate, else --request-rate when finite, else 1)",
    )
    cap.add_argument(
        "--capacity-steps", type=int, default=6, metavar="N", help=f"most runs per system {d}"
    )
    cap.add_argument(
        "--rate-tolerance",
        type=float,
        metavar="X",
        default=0.1,
        help=f"stop when the highest passing and lowest failing rate are within 1+X {d}",
    )
    cap.add_argument(
        "--prefill-tokens-per-s",
        type=_rate,
        metavar="X",
        help="prefill throughput for the offline bound, for every system (default: measured "
        "per system with a burst of --calibrate-requests prompts)",
    )
    cap.add_argument(
        "--calibrate-requests",
        type=int,
        metavar="N",
        default=16,
        help=f"prompts of the workload's mean input length sent at once, max_tokens 1 {d}",
    )
    cap.add_argument(
        "--bound-block",
        type=int,
        metavar="TOKENS",
        default=16,
        help=f"prefix-cache block in tokens of the offline bound's perfect cache {d}",
    )


def _sigterm_as_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_cli(args: argparse.Namespace) -> int:
    """``pdserve bench serve``: exit 0, 1 (failed start / bad input / a run in which nothing
    completed) or 2 (unreachable)."""
    from pdserve.bench.serve.history import check_history_args
    from pdserve.bench.serve.memory import resolve_memory

    find_capacity = getattr(args, "find_capacity", False)
    try:
        if find_capacity:
            from pdserve.bench.serve.capacity import check_args

            check_args(args)
        check_history_args(args)
        resolve_memory(args)
    except ValueError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    t0 = time.monotonic()
    from pdserve.bench.serve.run import run

    try:
        if find_capacity:
            from pdserve.bench.serve.capacity_run import run_capacity

            systems = run_capacity(args)
            say(f"total wall time {time.monotonic() - t0:.1f}s")
            # A system skipped as unreachable has its answer (none); one that ran must
            # have completed requests.
            ok = all(c.unreachable or any(p.completed for p in c.points) for c in systems)
            return 0 if ok else 1
        results = run(args)
    except BenchError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return exc.code
    except ValueError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench serve: interrupted", file=sys.stderr)
        return 130
    say(f"total wall time {time.monotonic() - t0:.1f}s")
    return 0 if all(r.metrics.completed for r in results) else 1
