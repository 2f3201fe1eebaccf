"""The baseline of ``--compare colocated-router``: the colocated engines of ``--compare
colocated`` (:func:`pdserve.bench.serve.baseline.started_engines`) behind vLLM's own router,
``vllm-router`` (vllm-project/router, a Rust binary shipped in a pip wheel), with its
prefix-aware ``cache_aware`` policy: each request goes to the engine whose earlier requests
share the longest prefix with it (an approximate radix tree of the prompts the router has
sent each engine, nothing shared between the engines), unless the engines' loads are too far
apart. This is what a user who wants prefix reuse without a shared KV store would run.

The router is a process the benchmark starts after the engines are ready and stops (by its
process group) before them; its output goes to ``vllm-router.log`` in the logs folder
(``--keep-logs``); it is ready when its ``/health`` answers 200 and its ``/v1/models`` lists
the model."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdserve.bench.serve.status import BenchError, say

#: The version the flags below were checked against (``vllm-router --help``); pyproject.toml's
#: ``bench`` extra pins it.
VLLM_ROUTER_VERSION = "0.1.17"
#: What to run when the binary is missing.
INSTALL_HINT = (
    f"pip install 'vllm-router=={VLLM_ROUTER_VERSION}' into pdserve's environment "
    "(make setup does: it is in the bench extra)"
)
#: ``--baseline-router-args``'s default: the cache-aware policy with the settings the router's
#: load-balancing guide configures for it (docs/load_balancing/README.md, "Cache Aware"): a
#: request goes to the engine with the longest prefix match when over half its prompt matches,
#: else to the least loaded; the least loaded always once the busiest has more than 32
#: requests in flight over the idlest and 1.1x as many. (The binary's own defaults are looser:
#: 0.3, 64 and 1.5.)
CACHE_AWARE_ARGS = (
    "--policy cache_aware --cache-threshold 0.5 --balance-abs-threshold 32 "
    "--balance-rel-threshold 1.1"
)
#: Seconds the router may take to answer once the engines are ready.
ROUTER_START_TIMEOUT_S = 60.0
#: Seconds its graceful shutdown may take before it is killed (a few, measured).
ROUTER_STOP_TIMEOUT_S = 20.0


def add_router_arguments(group: argparse._ArgumentGroup) -> None:
    """The flag of ``pdserve bench serve`` for the router of ``--compare colocated-router``."""
    group.add_argument(
        "--baseline-router-args",
        default=CACHE_AWARE_ARGS,
        metavar="ARGS",
        help="--compare colocated-router: flags of 'vllm-router' besides its address, "
        "workers and metrics port, e.g. '--policy round_robin' (default: the cache-aware "
        f"settings of the router's load-balancing guide: {CACHE_AWARE_ARGS})",
    )


def find_vllm_router(search_path: str | None = None) -> str:
    """The ``vllm-router`` executable: beside this interpreter (its virtual environment),
    else on ``search_path`` (default ``$PATH``).

    Raises:
        BenchError: it is not installed (the message names the pip command).
    """
    if search_path is None:
        search_path = os.pathsep.join(
            [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        )
    found = shutil.which("vllm-router", path=search_path)
    if found is None:
        raise BenchError(f"--compare colocated-router needs vllm-router, not found: {INSTALL_HINT}")
    return found


def router_argv(
    binary: str, port: int, metrics_port: int, workers: Sequence[str], router_args: str
) -> list[str]:
    """The ``vllm-router`` command line: on 127.0.0.1:``port`` in front of ``workers`` (base
    URLs), ``router_args`` (the policy and its settings), its Prometheus endpoint on
    ``metrics_port`` (its default, 29000, would collide with another router on the host), and
    a worker check every second while it starts (its default is 30 s; the engines are ready
    before it starts, so the first check passes)."""
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    argv += shlex.split(router_args)
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return [*argv, "--worker-startup-check-interval", "1"]


def warm_engines(bases: Sequence[str], model: str, timeout: float = 120.0) -> None:
    """One short completion straight to each engine. The round-robin baseline's warm-up
    requests reach every engine; the router sends the bench's warm-up (random prompts, no
    prefix match, equal loads) all to one engine, so each is warmed here first.

    Raises:
        BenchError: an engine does not answer 200.
    """
    body = {"model": model, "prompt": list(range(100, 116)), "max_tokens": 4, "temperature": 0}
    for base in bases:
        req = urllib.request.Request(
            f"{base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
        except OSError as exc:
            raise BenchError(f"warm-up of the engine at {base} failed: {exc}") from None


@contextlib.contextmanager
def started_router(
    workers: Sequence[str],
    model: str,
    work: Path,
    router_args: str = CACHE_AWARE_ARGS,
    timeout: float = ROUTER_START_TIMEOUT_S,
    binary: str | None = None,
) -> Iterator[str]:
    """``vllm-router`` in front of ``workers`` for the duration of the block, its output in
    ``work/vllm-router.log``; yields its base URL once ``/health`` answers 200 and
    ``/v1/models`` lists ``model``; stops it (its process group) after.

    Raises:
        BenchError: the binary is missing, or it exits or is not ready within ``timeout``
            (with its log's tail).
    """
    from pdserve.bench.serve.harness import spawn, wait_http_ready
    from pdserve.procs import free_ports

    binary = binary or find_vllm_router()
    port, metrics_port = free_ports(2)
    argv = router_argv(binary, port, metrics_port, workers, router_args)
    say(f"starting vllm-router: {shlex.join(argv[1:])}")
    t0 = time.monotonic()
    # NO_COLOR: plain text in the log (its tracing output is colored otherwise)
    proc = spawn("vllm-router", argv, work / "vllm-router.log", {"NO_COLOR": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(proc, url, model, timeout)
        say(f"vllm-router (pid {proc.pid}) ready in {time.monotonic() - t0:.1f}s at {url}")
        yield url
    finally:
        say(f"stopping vllm-router (pid {proc.pid})")
        proc.stop(ROUTER_STOP_TIMEOUT_S)


@contextlib.contextmanager
def started_colocated_router(args: argparse.Namespace, work: Path) -> Iterator[str]:
    """Runs the ``colocated-router`` baseline: the colocated engines, each warmed (unless
    ``--warmup 0``), behind
    ``vllm-router`` with ``args.baseline_router_args``; yields the router's URL."""
    from pdserve.bench.serve.baseline import started_engines

    binary = find_vllm_router()  # before the engines start
    with started_engines(args, work) as bases:
        if args.warmup > 0:
            warm_engines(bases, args.model, args.request_timeout)
        with started_router(
            bases, args.model, work, args.baseline_router_args, binary=binary
        ) as url:
            say(f"colocated-router baseline ready at {url} -> {bases}")
            yield url
