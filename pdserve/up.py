"""``pdserve up``: a whole cluster on one machine with embedded defaults.

Starts, in order, meta (memory backend, or etcd), the KV store master, the storage nodes, the
prefill and decode workers (in parallel) and the router; waits until each is healthy; prints
the endpoints and a ready-to-paste example; streams each service's log to its own file; and on
Ctrl-C / SIGTERM stops everything in reverse order, leaving no process or shared-memory segment
behind. ``--config cluster.yaml`` scales it: its ``up`` section holds the fields below, and the
same file is handed to every service, so its ``meta``, ``kvstore_master``, ``kvstore_node``,
``prefill``, ``decode`` and ``router`` sections tune each one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import config
from pdserve.config import ConfigError, help_field


@dataclass
class UpConfig:
    prefill_workers: int = help_field(
        -1,
        "prefill-only workers (-1 = auto: none, every worker prefills and decodes; >0 = "
        "disaggregated prefill pool)",
    )
    decode_workers: int = help_field(
        0,
        "decode workers, which also prefill what the router places on them (0 = auto: one per "
        "core, at most 8, when there are no prefill workers; else one)",
    )
    storage_nodes: int = help_field(1, "KV store storage nodes")
    segment_size: str = help_field("2GiB", "memory each storage node contributes", metavar="SIZE")
    engine: str = help_field(
        "auto", "model backend of the workers: auto (vllm when installed, else torch), torch, vllm"
    )
    model: str = help_field("smollm2", "model name ('smollm2', 'tiny') or a model directory")
    chunk_size: int = help_field(
        32,
        "KV chunk size in tokens: the unit of prefix reuse through the store (vllm: a multiple "
        "of its 32-token block)",
    )
    meta_backend: str = help_field("memory", "meta registry backend: memory or etcd")
    etcd_endpoints: list[str] = field(
        default_factory=lambda: ["127.0.0.1:2379"],
        metadata={"help": "etcd host:port list (meta_backend=etcd)", "metavar": "HOST:PORT,..."},
    )
    host: str = help_field("127.0.0.1", "address every service binds to")
    meta_port: int = help_field(50050, "meta gRPC port")
    meta_http_port: int = help_field(50080, "meta's Mooncake HTTP metadata port (-1 = off)")
    master_port: int = help_field(50051, "KV store master gRPC port")
    router_port: int = help_field(50060, "router gRPC port")
    http_port: int = help_field(8000, "router OpenAI-compatible HTTP port")
    run_dir: str = help_field(".pdserve/run", "folder for logs and state (logs/<service>.log)")
    ready_timeout_s: float = help_field(600.0, "how long to wait for each service to be ready")

    def validate(self) -> None:
        if self.storage_nodes < 1:
            raise ConfigError(f"storage_nodes must be at least 1, got {self.storage_nodes}")
        if self.decode_workers < 0:
            raise ConfigError(f"decode_workers must be >= 0 (0 = auto), got {self.decode_workers}")
        if self.prefill_workers < -1:
            raise ConfigError(
                f"prefill_workers must be >= 0 (or -1 = auto), got {self.prefill_workers}"
            )
        if self.engine not in ("auto", "torch", "vllm"):
            raise ConfigError(f"engine must be 'auto', 'torch' or 'vllm', got {self.engine!r}")
        if self.meta_backend not in ("memory", "etcd"):
            raise ConfigError(f"meta_backend must be 'memory' or 'etcd', got {self.meta_backend!r}")

    def resolve(self) -> None:
        """Replaces the auto values (engine, topology) with what they mean on this machine."""
        if self.engine == "auto":
            self.engine = "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
        if self.prefill_workers < 0:
            self.prefill_workers = 0
        if self.decode_workers == 0:
            cores = os.cpu_count() or 1
            self.decode_workers = min(cores, 8) if self.prefill_workers == 0 else 1


@dataclass
class Cluster:
    """The services of one ``pdserve up``, in start order."""

    cfg: UpConfig
    config_path: str | None
    procs: list = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "logs"

    def _common(self) -> list[str]:
        return ["--config", self.config_path] if self.config_path else []

    def _start(self, specs: list[tuple[str, list[str]]]) -> list:
        from pdserve import grpcutil
        from pdserve.procs import spawn_service, wait_ready

        started = [
            spawn_service(name, [*args, *self._common()], self.log_dir) for name, args in specs
        ]
        self.procs.extend(started)
        for proc in started:
            _progress(f"waiting for {proc.name} (log: {proc.log_path})")
            wait_ready(proc, self.cfg.ready_timeout_s)
            if "grpc" in proc.info and not asyncio.run(grpcutil.check_health(proc.info["grpc"])):
                raise RuntimeError(f"{proc.name} is up but its gRPC health check fails")
            _progress(f"{proc.name} ready: {_endpoints(proc.info)}")
        return started

    def start(self) -> None:
        from pdserve.procs import service_args

        c = self.cfg
        meta = f"{c.host}:{c.meta_port}"
        master = f"{c.host}:{c.master_port}"
        etcd = ",".join(c.etcd_endpoints) if c.meta_backend == "etcd" else None
        meta_args = service_args(
            "meta",
            host=c.host,
            port=c.meta_port,
            http_port=c.meta_http_port,
            backend=c.meta_backend,
            etcd_endpoints=etcd,
        )
        self._start([("meta", meta_args)])
        state_dir = Path(c.run_dir) / "kvstore-master"
        master_args = service_args(
            "kvstore-master", host=c.host, port=c.master_port, state_dir=state_dir, meta=meta
        )
        self._start([("kvstore-master", master_args)])
        nodes = [
            (
                f"kvstore-node-{i}",
                service_args(
                    "kvstore-node",
                    master_address=master,
                    # unique per cluster: node ids name /dev/shm segments, so two `pdserve up`
                    # on one host must not share them
                    node_id=f"node-{i}-{c.master_port}",
                    segment_sizes=c.segment_size,
                    host=c.host,
                    meta=meta,
                ),
            )
            for i in range(c.storage_nodes)
        ]
        self._start(nodes)
        workers = [("prefill", i) for i in range(c.prefill_workers)]
        workers += [("decode", i) for i in range(c.decode_workers)]
        cores = os.cpu_count() or 1
        self._start(
            [
                (
                    f"{role}-{i}",
                    service_args(
                        role,
                        engine=c.engine,
                        model=c.model,
                        chunk_size=c.chunk_size,
                        store_master=master,
                        meta=meta,
                        host=c.host,
                        instance_id=f"{role}-{i}",
                        # one engine per core: vLLM pins its OpenMP threads
                        vllm_cpu_cores=n % cores if c.engine == "vllm" else None,
                    ),
                )
                for n, (role, i) in enumerate(workers)
            ]
        )
        router_args = service_args(
            "router",
            host=c.host,
            port=c.router_port,
            http_port=c.http_port,
            meta=meta,
            store_master=master,
            model=c.model,
            chunk_size=c.chunk_size,
        )
        (router,) = self._start([("router", router_args)])
        self._wait_for_workers(router.info["grpc"])

    def _wait_for_workers(self, router: str) -> None:
        """Ready means the router routes: it must see every worker ``up`` started."""
        from pdserve import grpcutil
        from pdserve.v1 import router_pb2, router_pb2_grpc

        want = (self.cfg.prefill_workers, self.cfg.decode_workers)
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        with grpcutil.sync_channel(router) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            while True:
                models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models
                seen = (
                    sum(m.prefill_workers for m in models),
                    sum(m.decode_workers for m in models),
                )
                if seen[0] >= want[0] and seen[1] >= want[1]:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router sees (prefill, decode) workers {seen}, want {want}")
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.alive():
                _progress(f"stopping {proc.name} (pid {proc.pid})")
                code = proc.stop()
                if code not in (0, None, -signal.SIGTERM):
                    _progress(f"{proc.name} exited with code {code}; see {proc.log_path}")
        self.procs.clear()

    def wait(self) -> str:
        """Blocks until a service dies or a signal arrives; returns why."""
        stopping: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            stopping.append(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stopping:
            for proc in self.procs:
                if not proc.alive():
                    return (
                        f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.log_tail()}"
                    )
            time.sleep(0.5)
        return f"received {stopping[0]}"


def _endpoints(info: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in info.items() if k != "service")


def _progress(msg: str) -> None:
    print(f"[pdserve up] {msg}", file=sys.stderr, flush=True)


def banner(cfg: UpConfig) -> str:
    http = f"http://{cfg.host}:{cfg.http_port}"
    grpc_addr = f"{cfg.host}:{cfg.router_port}"
    return f"""
pdserve is up.
  OpenAI-compatible HTTP  {http}/v1   (health: {http}/health, metrics: {http}/metrics)
  gRPC (pdserve.v1.RouterService)  {grpc_addr}
  meta (registry)  {cfg.host}:{cfg.meta_port}   KV store master  {cfg.host}:{cfg.master_port}
  logs  {Path(cfg.run_dir) / "logs"}/<service>.log      status: pdserve status

Try it:
  curl -s {http}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{cfg.model}", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}}'

  .venv/bin/pdserve generate --router {grpc_addr} --model {cfg.model} "Once upon a time"

  grpcurl -plaintext -d '{{"model": "{cfg.model}", "prompt": "Once upon a time", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
    {grpc_addr} pdserve.v1.RouterService/GenerateStream

Ctrl-C stops everything.
"""


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config.from_args(UpConfig, "up", args)
        cfg.resolve()
    except ConfigError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(cfg, args.config)
    t0 = time.monotonic()
    # SIGTERM while starting stops what already started, as Ctrl-C does (the services run in
    # their own sessions: an `up` killed outright would leave them running)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
    except (OSError, RuntimeError) as exc:
        print(f"pdserve up: start failed: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    print(banner(cfg), flush=True)
    _progress(f"healthy in {time.monotonic() - t0:.1f}s")
    reason = cluster.wait()
    _progress(f"shutting down: {reason}")
    cluster.stop()
    return 0 if reason.startswith("received") else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a whole cluster on this machine (meta, KV store, workers, router)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_arguments(p, UpConfig)
    p.set_defaults(func=run)
