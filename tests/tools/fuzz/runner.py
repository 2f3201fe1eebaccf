"""Running the fuzzers: hypothesis cases on one surface with a liveness check after each
(:func:`fuzz`), the processes a run needs (:func:`surfaces_for`), and a whole run with its
table (:func:`run`)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

from .cases import Case, Surface
from .control_wire import Wire
from .engine import WORKER_FLAGS, Engine, start_workers
from .invariants import (
    Dead,
)
from .meta import Meta
from .router import RouterGrpc, RouterHttp
from .store import STORE_MASTER_FLAGS, Master, StoreTarget
from .tcp_port import TcpPort

#: Every surface, in the order a run fuzzes them.
SURFACES = ("router-http", "router-grpc", "engine", "master", "wire", "tcp", "meta")


@dataclass
class Tally:
    """One surface's run: cases sent, seconds taken and the broken invariants."""

    surface: str
    cases: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def fuzz(surface: Surface, cases: int, *, collect: bool = False) -> Tally:
    """Runs ``cases`` hypothesis cases on ``surface``, each followed by a liveness check.
    A broken invariant raises (shrunk by hypothesis), or with ``collect`` is counted and the
    run goes on (until the server stops answering)."""
    tally = Tally(surface.name)
    phases = [Phase.generate] if collect else [Phase.generate, Phase.shrink]

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(surface.cases())
    def one(case: Case) -> None:
        tally.cases += 1
        try:
            surface.check(case)
            surface.alive()
        except Dead:
            raise
        except Exception as exc:
            if not collect:
                raise
            tally.failures.append(f"{type(exc).__name__}: {exc} <- {case!r}")

    start = time.monotonic()
    try:
        one()
    except Exception as exc:
        if not collect:
            raise
        tally.failures.append(f"{type(exc).__name__}: {exc}")
    tally.seconds = time.monotonic() - start
    return tally


def surfaces_for(names: list[str], stack: contextlib.ExitStack, log_dir: Path) -> list[Surface]:
    """Starts what ``names`` need, stopped with ``stack``: a KV store, torch prefill and decode
    workers on the tiny model, a real router in front of them, a meta; the surfaces in
    order."""
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store, service_args, start_service

    made: dict[str, Surface] = {}
    if set(names) - {"meta"}:
        master, node = stack.enter_context(
            local_store(log_dir, segment_size="4MiB", master_flags=STORE_MASTER_FLAGS)
        )
        store = StoreTarget.of(master.info, node.info)
        made.update(master=Master(store), wire=Wire(store), tcp=TcpPort(store))
    if {"router-http", "router-grpc", "engine"} & set(names):
        prefill, decode = start_workers(log_dir, store.master)
        stack.callback(prefill.stop)
        stack.callback(decode.stop)
        made["engine"] = Engine(prefill.info["grpc"], decode.info["grpc"], "tiny")
    if {"router-http", "router-grpc"} & set(names):
        router = start_service(
            "fuzz-router",
            service_args(
                "router",
                model=build_tiny_model(),
                served_name="tiny",
                prefill=prefill.info["grpc"],
                decode=decode.info["grpc"],
                port=0,
                http_port=0,
                max_tokens_limit=WORKER_FLAGS["max_tokens_limit"],
                default_max_tokens=8,
            ),
            log_dir,
        )
        stack.callback(router.stop)
        made["router-http"] = RouterHttp(router.info["http"].removeprefix("http://"), "tiny")
        made["router-grpc"] = RouterGrpc(router.info["grpc"], "tiny")
    if "meta" in names:
        meta = start_service(
            "fuzz-meta",
            service_args("meta", port=0, http_port=0, http_metadata=True, backend="memory"),
            log_dir,
        )
        stack.callback(meta.stop)
        http_address = urllib.parse.urlsplit(meta.info["http"]).netloc
        made["meta"] = Meta(meta.info["grpc"], http_address)
    return [made[n] for n in names]


def run(args: argparse.Namespace) -> int:
    """A fuzz run: ``args.cases`` cases on each of ``args.surfaces``; prints a
    table and the failures; 0 when every invariant held."""
    names = [n.strip() for n in args.surfaces.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SURFACES))
    if unknown or not names:
        print(f"unknown surfaces {unknown}; choose from {', '.join(SURFACES)}")
        return 2
    tallies = []
    with contextlib.ExitStack() as stack:
        log_dir = getattr(args, "log_dir", None)
        log_dir = (
            Path(log_dir) if log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for surface in surfaces_for(names, stack, log_dir):
            tally = fuzz(surface, args.cases, collect=True)
            print(
                f"{tally.surface}: {tally.cases} cases, {len(tally.failures)} failures", flush=True
            )
            tallies.append(tally)
    print(f"\n{'surface':<12} {'cases':>8} {'failures':>9} {'seconds':>8} {'cases/s':>8}")
    for t in tallies:
        rate = t.cases / t.seconds if t.seconds else 0.0
        print(f"{t.surface:<12} {t.cases:>8} {len(t.failures):>9} {t.seconds:>8.1f} {rate:>8.1f}")
    for t in tallies:
        for failure in dict.fromkeys(t.failures[:20]):
            print(f"\n[{t.surface}] {failure}")
    return 1 if any(t.failures for t in tallies) else 0
