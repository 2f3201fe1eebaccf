"""The colocated vLLM baselines of ``--compare``: plain ``vllm serve`` engines, one
per core, behind the round-robin proxy (:mod:`pdserve.bench.serve.proxy`, ``colocated``) or
vLLM's own router (:mod:`pdserve.bench.serve.vllm_router`, ``colocated-router``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pdserve import devices
from pdserve.bench.serve.harness import spawn, wait_http_ready
from pdserve.bench.serve.status import say
from pdserve.procs import ServiceProcess, free_ports


def baseline_vllm_flags() -> str:
    """Flags of the colocated baseline engines (ENVIRONMENT.md's baseline; the last flag only
    adds ``cached_tokens`` to the usage vLLM reports). ``--dtype`` is the one pdserve's vLLM
    workers pick on this machine (:func:`pdserve.devices.vllm_auto_dtype`), so that both
    systems compute in the same dtype."""
    return (
        f"--dtype {devices.vllm_auto_dtype(os.environ)} --max-model-len 4096 --block-size 32 --enforce-eager "
        "--enable-prefix-caching --enable-prompt-tokens-details"
    )


def baseline_env(core: int, kv_gib: float, tmp: Path) -> dict[str, str]:
    """Environment of the colocated baseline engine pinned to ``core``."""
    for sub in ("tmp", "vllm-cache", "inductor"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        "TMPDIR": str(tmp / "tmp"),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
    }


@contextlib.contextmanager
def started_engines(
    args: argparse.Namespace,
    work: Path,
    engine_args: Callable[[int], list[str]] = lambda i: [],
    procs: list[ServiceProcess] | None = None,
) -> Iterator[list[str]]:
    """The baseline's ``vllm serve`` engines, one per core (``args.baseline_args`` and
    ``engine_args(i)`` each), ready; yields their base URLs. Processes started in the
    ``with`` go in ``procs`` to be stopped first."""
    from pdserve.model.prepare import resolve_model

    model_dir = resolve_model(args.model)
    cores = os.cpu_count() or 1
    procs = procs if procs is not None else []
    engines: list[ServiceProcess] = []
    try:
        bases = []
        t0 = time.monotonic()
        for i in range(args.baseline_engines):
            port = free_ports(1)[0]
            argv = [sys.executable, "-m", "pdserve.commands.vllm", "serve", str(model_dir)]
            argv += ["--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port)]
            argv += shlex.split(args.baseline_args) + engine_args(i)
            env = baseline_env(i % cores, args.baseline_kv_cache_gib, work / f"vllm-{i}")
            pin = {i % cores} if args.baseline_pin else None
            where = f"core {i % cores}" + (", its whole process tree" if pin else "")
            say(f"starting vllm-{i} on {where}: {shlex.join(argv[1:])}")
            engines.append(spawn(f"vllm-{i}", argv, work / f"vllm-{i}.log", env, pin))
            bases.append(f"http://127.0.0.1:{port}")
        for proc, base in zip(engines, bases, strict=True):
            wait_http_ready(proc, base, args.model, args.start_timeout)
        say(f"{len(bases)} engines ready in {time.monotonic() - t0:.1f}s: {bases}")
        yield bases
    finally:
        t1 = time.monotonic()
        for proc in [*reversed(procs), *reversed(engines)]:
            say(f"stopping {proc.name}")
            proc.stop(60.0)
        say(f"engines stopped in {time.monotonic() - t1:.1f}s")


@contextlib.contextmanager
def started_colocated(args: argparse.Namespace, work: Path) -> Iterator[str]:
    """Runs the colocated vLLM baseline (engines + round-robin proxy); yields the proxy URL."""
    procs: list[ServiceProcess] = []
    with started_engines(args, work, procs=procs) as bases:
        port = free_ports(1)[0]
        argv = [sys.executable, "-m", "pdserve.bench.serve.proxy", str(port), *bases]
        procs.append(spawn("proxy", argv, work / "proxy.log"))
        proxy = f"http://127.0.0.1:{port}"
        wait_http_ready(procs[-1], proxy, args.model, 60.0)
        say(f"colocated baseline ready at {proxy} -> {bases}")
        yield proxy


#: ``--compare`` choices other than ``none``: each is a baseline, named so in the report.
BASELINES = ("colocated", "colocated-router")
#: ``--compare both``: every baseline of :data:`BASELINES`, in turn.
BOTH = "both"


def baselines(compare: str) -> tuple[str, ...]:
    """The baselines ``--compare`` names, in the order they run."""
    if compare == BOTH:
        return BASELINES
    return () if compare == "none" else (compare,)
