"""One ``pdserve bench serve`` run: the workload the flags describe, then each system in
turn (started or given), measured and reported."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.serve import vllm_router
from pdserve.bench.serve.baseline import baselines, started_colocated
from pdserve.bench.serve.client import send_workload
from pdserve.bench.serve.harness import logs_dir, started_pdserve
from pdserve.bench.serve.http import check_target, scrape
from pdserve.bench.serve.memory import pdserve_env
from pdserve.bench.serve.report import (
    SystemResult,
    format_better_baseline,
    format_comparison,
    format_result,
    write_json,
)
from pdserve.bench.serve.status import BenchError, say

if TYPE_CHECKING:
    from pdserve.bench.serve.history import HistoryPlan
    from pdserve.bench.serve.metrics import RequestRecord
    from pdserve.bench.serve.workloads import Request

MAX_ERRORS_SHOWN = 5


def model_vocab_size(model: str) -> int | None:
    """``vocab_size`` from the config.json of a model prepared here (None if unknown)."""
    from pdserve.model.prepare import known_model_dir

    try:
        cfg = json.loads((known_model_dir(model) / "config.json").read_text())
    except (ValueError, OSError):
        return None
    size = cfg.get("vocab_size")
    return int(size) if isinstance(size, int) else None


def vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size``, else the prepared model's, else SmolLM2's 49152."""
    from pdserve.bench.serve.workloads import DEFAULT_VOCAB

    return args.vocab_size or model_vocab_size(args.model) or DEFAULT_VOCAB


def build_workload(args: argparse.Namespace) -> tuple[Request, ...]:
    """The requests ``args`` describe (prints the trace's reuse fraction when loading one)."""
    from pdserve.bench.serve import workloads as wl

    common = {"seed": args.seed, "vocab_size": vocab_size(args)}
    if args.workload == "random":
        return wl.random_workload(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.request_rate,
            **common,
        )
    if args.workload == "prefix-repetition":
        return wl.prefix_repetition_workload(
            args.num_prompts,
            args.num_prefixes,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            args.request_rate,
            **common,
        )
    if args.workload == "multi-round":
        return wl.multi_round_workload(
            args.num_conversations,
            args.rounds,
            args.turn_len,
            args.output_len,
            args.request_rate,
            **common,
        )
    if args.workload == "long-prefill":
        return wl.long_prefill_workload(
            args.num_prompts,
            args.long_fraction,
            (args.long_len_min, args.long_len_max),
            args.output_len,
            args.input_len,
            args.stream_output_len,
            args.request_rate,
            **common,
        )
    if not args.trace:
        raise BenchError("--workload trace needs --trace FILE (make one with 'gen-trace')")
    from pdserve.bench.serve.history import trace_rows

    history, rows = trace_rows(args)
    say(f"trace {args.trace}: {len(rows)} rows, reuse fraction {wl.reuse_fraction(rows):.3f}")
    return wl.trace_workload(
        rows,
        block=args.block_tokens,
        time_scale=args.time_scale,
        output_scale=args.output_scale,
        min_output=args.min_output,
        max_output=args.max_output,
        first_index=len(history),
        **common,
    )


def bench_system(
    name: str,
    base: str,
    requests: Sequence[Request],
    args: argparse.Namespace,
    slos: dict[str, float],
    router_metrics: bool,
    key: str = "",
    history: HistoryPlan | None = None,
) -> SystemResult:
    """Runs the workload against ``base`` (with API key ``key``), after ``history`` when it
    has requests, and computes its numbers (exit 2 if unreachable)."""
    from pdserve.bench.serve.cpu import cpu_report, sample
    from pdserve.bench.serve.history import replay_history
    from pdserve.bench.serve.metrics import compute_metrics, router_figures

    check_target(base, args.model, key)
    replayed = (
        replay_history(name, base, key, history, args) if history and history.requests else None
    )
    scraped: dict[str, Any] = {}

    def before_measuring() -> None:
        scraped["before"] = scrape(base, key) if router_metrics else None
        scraped["t0"] = time.monotonic()
        scraped["cpu"] = sample(os.getpid(), scraped["t0"])

    vocab = vocab_size(args)
    records = asyncio.run(
        send_workload(base, args.model, requests, args, name, before_measuring, vocab, key)
    )
    cpu_after = sample(os.getpid(), time.monotonic())
    say(f"{name}: {len(records)} requests in {cpu_after.t - scraped['t0']:.1f}s")
    before = scraped["before"]
    after = scrape(base, key) if before is not None else None
    router = router_figures(before, after) if before is not None and after is not None else None
    if router is not None and not (router.prompt_tokens or router.phase_count):
        router = None
    _print_errors(name, records)
    metrics = compute_metrics(records, slos)
    # only the processes this run started: none below it when it measures a --target
    cpu = None
    if len(cpu_after.cpu_s) > 1:
        cpu = cpu_report(scraped["cpu"], cpu_after, metrics.completed)
    return SystemResult(name, base, metrics, router, tuple(records), replayed, cpu)


def _print_errors(name: str, records: Sequence[RequestRecord]) -> None:
    errors = [r for r in records if r.error]
    if not errors:
        return
    say(f"{name}: {len(errors)} of {len(records)} requests failed; first errors:")
    for r in errors[:MAX_ERRORS_SHOWN]:
        say(f"  request {r.index}: {r.error}")


def run(args: argparse.Namespace) -> list[SystemResult]:
    """Runs every system of ``args`` in turn, prints and writes the results."""
    from pdserve.bench.serve.history import plan_history
    from pdserve.bench.serve.memory import describe_shape, memory_shape
    from pdserve.bench.serve.metrics import parse_goodput
    from pdserve.bench.serve.reuse import format_reuse, reuse_json
    from pdserve.bench.serve.workloads import workload_stats

    slos = parse_goodput(args.goodput or [])
    requests = build_workload(args)
    if not requests:
        raise BenchError("the workload has no requests")
    st = workload_stats(requests)
    say(
        f"workload {args.workload}: {st.requests} requests, mean input {st.mean_input:.1f} "
        f"tokens, output {st.min_output}-{st.max_output} (mean {st.mean_output:.1f}), "
        f"arrivals over {st.span_s:.1f}s"
    )
    history = plan_history(args, vocab_size(args))
    say(describe_shape(args))
    if args.compare != "none" and args.start_pdserve is None:
        say("note: --target stays up while the baseline runs; make sure it is idle")
    results: list[SystemResult] = []
    with each_system(args) as systems:
        for system in systems:
            results.append(
                bench_system(
                    system.name,
                    system.url,
                    requests,
                    args,
                    slos,
                    system.is_target,
                    system.key,
                    history,
                )
            )
            print(format_result(results[-1]), flush=True)
    for baseline in results[1:]:
        print(format_comparison(results[0], baseline), flush=True)
    if len(results) > 2:
        print(format_better_baseline(results[0], results[1:]), flush=True)
    if history is not None:
        print(format_reuse(history, results), flush=True)
    path = result_path(args)
    if path:
        extra = {"memory": memory_shape(args)}
        if history is not None:
            extra["reuse"] = reuse_json(history, results)
        write_json(path, args, requests, results, extra)
        say(f"wrote {path}")
    if args.plot_dir:
        from pdserve.bench.serve.plots import write_plots

        paths = write_plots(args.plot_dir, {r.name: r.records for r in results}, args.window_s)
        say(f"wrote {', '.join(str(p) for p in paths)}")
    return results


@dataclass(frozen=True)
class System:
    """A system to measure while it is up: its name, base URL, API key, and whether it is
    the system under test (``--target`` or ``--start-pdserve``) or the baseline."""

    name: str
    url: str
    key: str
    is_target: bool


@contextlib.contextmanager
def each_system(
    args: argparse.Namespace, baseline_first: bool = False
) -> Iterator[Iterator[System]]:
    """The systems ``args`` name, one at a time: the system under test (started with
    ``--start-pdserve``, else ``--target``), then with ``--compare`` the baselines it names
    (``baseline_first``: the baselines first), each up only until the next is asked for (a
    logs folder holds what they started). A missing ``vllm-router`` fails before anything
    starts."""
    names = baselines(args.compare)
    if "colocated-router" in names:
        vllm_router.find_vllm_router()
    starts = args.start_pdserve is not None or bool(names)
    with logs_dir(args.keep_logs) if starts else contextlib.nullcontext(Path()) as work:

        def target() -> Iterator[System]:
            if args.start_pdserve is not None:
                started = started_pdserve(
                    args.start_pdserve, args.model, work, args.start_timeout, pdserve_env(args)
                )
                with started as (url, key):
                    yield System(args.label, url, key, True)
            else:
                key = args.api_key or os.environ.get("PDSERVE_API_KEY", "")
                yield System(args.label, args.target, key, True)

        def baseline() -> Iterator[System]:
            for name in names:
                router = name == "colocated-router"
                start = vllm_router.started_colocated_router if router else started_colocated
                with start(args, work) as url:
                    yield System(name, url, "", False)

        def systems() -> Iterator[System]:
            order = (baseline, target) if baseline_first else (target, baseline)
            for each in order:
                yield from each()

        with contextlib.closing(systems()) as each:
            yield each


def result_path(args: argparse.Namespace) -> str:
    """Where the run's JSON goes: ``--json``, else (``--save-result``, as ``vllm bench serve``)
    ``--result-dir``/``--result-filename``; "" for none."""
    if args.json or not args.save_result:
        return args.json or ""
    name = args.result_filename or f"pdserve-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(args.result_dir or ".") / name)
