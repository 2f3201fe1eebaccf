"""``pdserve up``: a whole cluster on one machine with embedded defaults.

Starts, in order, meta (memory backend, or etcd), the KV store master, the storage nodes, the
prefill and decode workers (in parallel) and the router; waits until each is healthy; prints
the endpoints and a ready-to-paste example; streams each service's log to its own file. It
then supervises: a service that dies is logged and restarted with backoff (1 s doubling to
30 s, reset once it has run for a minute) while the rest keeps serving, and
``<run_dir>/services.json`` (shown by ``pdserve status``) says what runs, its restarts and
last exit. On Ctrl-C / SIGTERM it stops everything in reverse order, leaving no process or
shared-memory segment behind. ``--config cluster.yaml`` scales it: its ``up`` section holds the fields below, and the
same file is handed to every service, so its ``meta``, ``kvstore_master``, ``kvstore_node``,
``prefill``, ``decode`` and ``router`` sections tune each one.

``--store-backend mooncake`` runs the whole system on a real Mooncake Store instead of
pdserve's own: ``mooncake_master`` (on master_port) and storage_nodes processes contributing
segment_size each (``pdserve mooncake master`` / ``storage``), supervised like the rest; the
workers and the router reach it with ``--store-backend mooncake``. Mooncake's links carry no
TLS: ``up`` binds them to 127.0.0.1.

Secure by default: the services talk mutual TLS, each with its own identity (certificates in
``<run_dir>/certs``, made with ``pdserve certs``'s code from one CA that later runs reuse;
``up`` itself, and ``pdserve status --run-dir``, act as ``admin``), and the router requires an
API key (``<run_dir>/api_key``, mode 0600). ``--no-tls`` / ``--no-auth`` turn them off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import config
from pdserve.config import ConfigError, help_field

if TYPE_CHECKING:
    from pdserve.devices import Placement
    from pdserve.identity import TlsFiles


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
    storage_nodes: int = help_field(
        1, "KV store storage nodes (store_backend mooncake: Mooncake storage processes)"
    )
    segment_size: str = help_field("2GiB", "memory each storage node contributes", metavar="SIZE")
    store_backend: str = help_field(
        "pdserve",
        "the KV store up runs: pdserve (pdserve kvstore master + storage nodes, mutual TLS) or "
        "mooncake (a real Mooncake Store: mooncake_master on master_port, storage_nodes "
        "processes of segment_size each; Mooncake's links have no TLS, so they bind 127.0.0.1)",
    )
    store_metadata_server: str = help_field(
        "P2PHANDSHAKE",
        "store_backend mooncake: the Transfer Engines' metadata server: P2PHANDSHAKE (engines "
        "handshake peer to peer, no server), meta (pdserve meta's HTTP metadata endpoint on "
        "meta_http_port; needs tls off, as the pinned Mooncake cannot check meta's HTTPS "
        "certificate) or an http://, etcd:// or redis:// URL",
        metavar="SERVER",
    )
    engine: str = help_field(
        "auto", "model backend of the workers: auto (vllm when installed, else torch), torch, vllm"
    )
    model: str = help_field("smollm2", "model name ('smollm2', 'tiny') or a model directory")
    chunk_size: int = help_field(
        32,
        "KV chunk size in tokens: the unit of prefix reuse through the store (vllm: a multiple "
        "of its 32-token block)",
    )
    kv_compression: str = help_field(
        "none",
        "encoding of the KV chunks every worker stores (none, bf16, fp8): bf16 "
        "halves float32 KV (a no-op on bfloat16 KV, vllm's default), fp8 (e4m3, a scale per "
        "channel) halves bfloat16 KV; read back in the workers' KV dtype, with fp8 close to "
        'but not token-exact with none (docs/benchmarks.md, "KV compression")',
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
    tls: bool = help_field(
        True,
        "mutual TLS between the services; certificates are made in <run_dir>/certs by "
        "`pdserve certs`'s code (its CA is kept and reused by later runs)",
    )
    auth: bool = help_field(
        True,
        "require an API key on the router; it is generated into <run_dir>/api_key (0600, kept "
        "across runs) unless api_key / PDSERVE_UP_API_KEY is set",
    )
    api_key: str = help_field(
        "",
        "the API key the router requires on HTTP and gRPC ('' = generated, see auth); set it "
        "with PDSERVE_UP_API_KEY rather than a flag. It reaches the router in <run_dir>/api_key",
    )
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
        from pdserve.hashing import KV_COMPRESSIONS  # numpy: not at `pdserve --help`

        if self.kv_compression not in KV_COMPRESSIONS:
            raise ConfigError(
                f"kv_compression must be one of {KV_COMPRESSIONS}, got {self.kv_compression!r}"
            )
        if self.meta_backend not in ("memory", "etcd"):
            raise ConfigError(f"meta_backend must be 'memory' or 'etcd', got {self.meta_backend!r}")
        self._validate_store()
        if self.api_key and not self.auth:
            raise ConfigError(
                "api_key is set but auth is off: unset api_key (PDSERVE_UP_API_KEY) or turn auth on"
            )

    def _validate_store(self) -> None:
        if self.store_backend not in ("pdserve", "mooncake"):
            raise ConfigError(
                f"store_backend must be 'pdserve' or 'mooncake', got {self.store_backend!r}"
            )
        if self.store_backend == "pdserve":
            if self.store_metadata_server != "P2PHANDSHAKE":
                raise ConfigError(
                    f"store_metadata_server {self.store_metadata_server!r} applies to "
                    "store_backend mooncake; pdserve's own store uses no metadata server"
                )
            return
        if self.host not in LOOPBACK_OR_ANY:
            raise ConfigError(
                f"store_backend mooncake: up binds Mooncake (no TLS on its links) to 127.0.0.1, "
                f"so host must be loopback or a wildcard ({', '.join(LOOPBACK_OR_ANY)}), got "
                f"{self.host!r}; across hosts run Mooncake yourself and point the services at it"
            )
        if self.store_metadata_server == "meta":
            if self.meta_http_port < 0:
                raise ConfigError("store_metadata_server meta needs meta_http_port >= 0")
            if self.tls:
                raise ConfigError(
                    "store_metadata_server meta needs tls off: with TLS meta serves HTTPS, "
                    "whose certificate the pinned Mooncake client cannot check (its libcurl "
                    "trusts only the host's CA store); use P2PHANDSHAKE (the default)"
                )
            return
        from pdserve import compat

        compat.check_metadata_server(self.store_metadata_server, what="store_metadata_server")

    def mooncake_metadata(self) -> str:
        """The metadata server the Mooncake clients get (store_backend mooncake)."""
        if self.store_metadata_server == "meta":
            return f"http://{MOONCAKE_HOST}:{self.meta_http_port}/metadata"
        return self.store_metadata_server

    def resolve(self, gpus: Sequence[str] = ()) -> None:
        """Replaces the auto values (engine, topology) with what they mean on this machine,
        whose visible GPUs are ``gpus`` (:func:`pdserve.devices.visible_gpus`): one worker
        per GPU (vLLM), else per core, at most 8."""
        if self.engine == "auto":
            self.engine = "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
        if self.prefill_workers < 0:
            self.prefill_workers = 0
        if self.decode_workers == 0:
            units = len(gpus) if gpus and self.engine == "vllm" else os.cpu_count() or 1
            self.decode_workers = min(units, 8) if self.prefill_workers == 0 else 1

    def workers(self) -> list[tuple[str, int]]:
        """(role, index) of every worker, in start order (after :meth:`resolve`)."""
        return [("prefill", i) for i in range(self.prefill_workers)] + [
            ("decode", i) for i in range(self.decode_workers)
        ]


#: Where ``up`` binds Mooncake (store_backend mooncake), and the ``host`` values it accepts then.
MOONCAKE_HOST = "127.0.0.1"
LOOPBACK_OR_ANY = ("127.0.0.1", "localhost", "0.0.0.0", "::")
#: Services started without ``--config`` (they are not pdserve config sections).
NO_CONFIG = ("mooncake-",)
MOONCAKE_SECURITY_NOTE = (
    "store backend mooncake: Mooncake's own links (mooncake_master RPC, Transfer Engine data "
    "and handshakes) carry no TLS and no authentication, unlike pdserve's services (mutual "
    f"TLS); up binds them to {MOONCAKE_HOST}, so only local processes reach the KV cache"
)

#: Seconds before the n-th restart in a row of a service (the last value repeats).
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
#: A service that ran this long (seconds) starts its backoff over.
STABLE_S = 60.0
#: What ``up`` writes for ``pdserve status``, in the run dir.
SERVICES_FILE = "services.json"
#: The run dir's certificates (``pdserve certs`` layout) and the router's API key file.
CERTS_DIR = "certs"
API_KEY_FILE = "api_key"
#: The identity ``up`` (and ``pdserve status --run-dir``) dials the internal services as.
ADMIN = "admin"


def tls_files(run_dir: str | Path, name: str) -> dict[str, str]:
    """The ``tls_*`` config fields of identity ``name`` in ``run_dir``'s certificates."""
    d = (Path(run_dir) / CERTS_DIR).resolve()
    return {
        "tls_ca": str(d / "ca.crt"),
        "tls_cert": str(d / f"{name}.crt"),
        "tls_key": str(d / f"{name}.key"),
    }


def admin_tls(run_dir: str | Path) -> TlsFiles | None:
    """``up``'s admin identity in ``run_dir`` (ConfigError when its files are missing)."""
    from pdserve.identity import TlsFiles

    return TlsFiles.load(
        **{k.removeprefix("tls_"): v for k, v in tls_files(run_dir, ADMIN).items()}
    )


@dataclass
class Supervised:
    """One service's supervision record."""

    args: list[str]
    #: environment it starts with besides up's own (a worker's GPU)
    env: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    in_a_row: int = 0
    last_exit: int | None = None
    #: "running", "restarting" (waiting out its backoff) or "starting" (not ready yet).
    state: str = "running"
    #: monotonic time of the next start while restarting.
    next_start: float = 0.0


@dataclass
class Cluster:
    """The services of one ``pdserve up``, in start order."""

    cfg: UpConfig
    config_path: str | None
    #: each worker's share of the machine, in ``cfg.workers()`` order (:mod:`pdserve.devices`)
    places: Sequence[Placement] = ()
    procs: list = field(default_factory=list)
    supervised: dict[str, Supervised] = field(default_factory=dict)
    stopping: bool = False
    #: This cluster's restart threads (the finished ones are dropped as new ones start).
    restarts: list[threading.Thread] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "logs"

    def _common(self) -> list[str]:
        return ["--config", self.config_path] if self.config_path else []

    def _start(self, specs: list[tuple[str, list[str]]], envs: Sequence[dict] = ()) -> list:
        """Starts ``specs`` (name, args), each with its ``envs`` entry added to its
        environment, and waits until each is ready."""
        from pdserve import grpcutil
        from pdserve.procs import spawn_service, wait_ready

        started = []
        for n, (name, args) in enumerate(specs):
            full = args if name.startswith(NO_CONFIG) else [*args, *self._common()]
            env = dict(envs[n]) if n < len(envs) else {}
            started.append(spawn_service(name, full, self.log_dir, env=env))
            self.supervised[name] = Supervised(full, env)
        self.procs.extend(started)
        for proc in started:
            _progress(f"waiting for {proc.name} (log: {proc.log_path})")
            wait_ready(proc, self.cfg.ready_timeout_s)
            public = proc.name == "router"  # its gRPC port is the public API, no client certs
            if "grpc" in proc.info and not asyncio.run(
                grpcutil.check_health(proc.info["grpc"], public=public)
            ):
                raise RuntimeError(f"{proc.name} is up but its gRPC health check fails")
            _progress(f"{proc.name} ready: {_endpoints(proc.info)}")
        return started

    def start(self) -> None:
        from pdserve.procs import service_args

        c = self.cfg
        mooncake = c.store_backend == "mooncake"
        meta = f"{c.host}:{c.meta_port}"
        master = f"{MOONCAKE_HOST if mooncake else c.host}:{c.master_port}"
        etcd = ",".join(c.etcd_endpoints) if c.meta_backend == "etcd" else None
        # unique per cluster: node ids name /dev/shm segments, so two `pdserve up` on one host
        # must not share them (and a node's certificate names its node id)
        node_ids = [] if mooncake else [f"node-{i}-{c.master_port}" for i in range(c.storage_nodes)]
        workers = c.workers()
        if mooncake:
            from pdserve.store.mooncake_backend import available

            if not available():
                raise RuntimeError(
                    "store_backend mooncake needs the mooncake wheel (pip install "
                    "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1): "
                    "mooncake.store does not import"
                )
            _progress(MOONCAKE_SECURITY_NOTE)
        self._secure(
            [
                "meta:meta",
                *([] if mooncake else ["master:kvstore-master"]),
                *(f"node:{n}" for n in node_ids),
                *(f"worker:{role}-{i}" for role, i in workers),
                "router:router",
                f"admin:{ADMIN}",
            ]
        )
        meta_args = service_args(
            "meta",
            host=c.host,
            port=c.meta_port,
            http_port=c.meta_http_port,
            backend=c.meta_backend,
            etcd_endpoints=etcd,
            **self._tls("meta"),
        )
        self._start([("meta", meta_args)])
        if mooncake:
            self._start_mooncake(master)
        else:
            self._start_pdserve_store(meta, master, node_ids)
        store = (
            dict(store_backend="mooncake", store_metadata_server=c.mooncake_metadata())
            if mooncake
            else {}
        )
        self._start_workers_and_router(meta, master, workers, store)

    def _start_pdserve_store(self, meta: str, master: str, node_ids: list[str]) -> None:
        """pdserve's own KV store: its master, then the storage nodes."""
        from pdserve.procs import service_args

        c = self.cfg
        state_dir = Path(c.run_dir) / "kvstore-master"
        master_args = service_args(
            "kvstore-master",
            host=c.host,
            port=c.master_port,
            state_dir=state_dir,
            meta=meta,
            **self._tls("kvstore-master"),
        )
        self._start([("kvstore-master", master_args)])
        nodes = [
            (
                f"kvstore-node-{i}",
                service_args(
                    "kvstore-node",
                    master_address=master,
                    node_id=node_id,
                    segment_sizes=c.segment_size,
                    host=c.host,
                    meta=meta,
                    **self._tls(node_id),
                ),
            )
            for i, node_id in enumerate(node_ids)
        ]
        self._start(nodes)

    def _start_mooncake(self, master: str) -> None:
        """A Mooncake Store on 127.0.0.1: mooncake_master, then the storage processes."""
        from pdserve.procs import service_args

        c = self.cfg
        self._start(
            [
                (
                    "mooncake-master",
                    service_args("mooncake-master", host=MOONCAKE_HOST, port=c.master_port),
                )
            ]
        )
        self._start(
            [
                (
                    f"mooncake-storage-{i}",
                    service_args(
                        "mooncake-storage",
                        master=master,
                        segment_size=c.segment_size,
                        host=MOONCAKE_HOST,
                        metadata_server=c.mooncake_metadata(),
                    ),
                )
                for i in range(c.storage_nodes)
            ]
        )

    def _start_workers_and_router(
        self, meta: str, master: str, workers: list[tuple[str, int]], store: dict[str, str]
    ) -> None:
        from pdserve.devices import Placement
        from pdserve.procs import service_args

        c = self.cfg
        places = self.places or [Placement() for _ in workers]
        self._start(
            [
                (
                    f"{role}-{i}",
                    service_args(
                        role,
                        engine=c.engine,
                        model=c.model,
                        chunk_size=c.chunk_size,
                        kv_compression=c.kv_compression,
                        store_master=master,
                        **store,
                        meta=meta,
                        host=c.host,
                        instance_id=f"{role}-{i}",
                        # one engine per core: vLLM pins its OpenMP threads
                        vllm_cpu_cores=place.cpu_cores,
                        **self._tls(f"{role}-{i}"),
                    ),
                )
                for place, (role, i) in zip(places, workers, strict=True)
            ],
            [place.env for place in places],
        )
        router_args = service_args(
            "router",
            host=c.host,
            port=c.router_port,
            http_port=c.http_port,
            meta=meta,
            store_master=master,
            **store,
            model=c.model,
            chunk_size=c.chunk_size,
            api_key_file=self._key_file(),
            **self._tls("router"),
        )
        (router,) = self._start([("router", router_args)])
        self._wait_for_workers(router.info["grpc"])

    def _secure(self, identities: list[str]) -> None:
        """With TLS on, (re)issues every service's certificate and ``up``'s admin one from the
        run dir's CA (made once, then reused) and makes ``up`` dial as admin; with it off,
        ``up`` dials plaintext (whatever PDSERVE_TLS_* says)."""
        from pdserve import certs, identity

        c = self.cfg
        if not c.tls:
            identity.configure_files(None)
            return
        # leaf certificates are cheap: made anew each start, they follow a changed --host
        certs.make(Path(c.run_dir) / CERTS_DIR, identities, hosts=[c.host])
        identity.configure_files(admin_tls(c.run_dir))

    def _tls(self, name: str) -> dict[str, str]:
        """The tls_* flags of the service whose certificate is ``name`` (none: TLS off)."""
        return tls_files(self.cfg.run_dir, name) if self.cfg.tls else {}

    def _key_file(self) -> Path | None:
        """With auth on, writes the router's API key to ``<run_dir>/api_key`` (0600; a file,
        not a flag: flags show in `ps`): api_key, else the key an earlier run left there,
        else a new one. Sets ``cfg.api_key`` to it."""
        c = self.cfg
        if not c.auth:
            return None
        path = Path(c.run_dir) / API_KEY_FILE
        if not c.api_key:
            with contextlib.suppress(OSError):
                c.api_key = path.read_text().partition("\n")[0].strip()
            c.api_key = c.api_key or secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that exists
        with os.fdopen(fd, "w") as f:
            f.write(c.api_key + "\n")
        return path

    def _wait_for_workers(self, router: str) -> None:
        """Ready means the router routes: it must see every worker ``up`` started."""
        from pdserve import grpcutil
        from pdserve.auth import bearer
        from pdserve.v1 import router_pb2, router_pb2_grpc

        want = (self.cfg.prefill_workers, self.cfg.decode_workers)
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        with grpcutil.sync_channel(router, public=True) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            while True:
                models = stub.ListModels(
                    router_pb2.ListModelsRequest(), timeout=5, metadata=bearer(self.cfg.api_key)
                ).models
                seen = (
                    sum(m.prefill_workers for m in models),
                    sum(m.decode_workers for m in models),
                )
                if seen[0] >= want[0] and seen[1] >= want[1]:
                    return
                if time.monotonic() > deadline:
                    refused = [r for m in models for r in m.refused_workers]
                    raise RuntimeError(
                        f"router sees (prefill, decode) workers {seen}, want {want}"
                        + (f"; it refuses {refused}" if refused else "")
                    )
                time.sleep(0.2)

    def stop(self) -> None:
        self.stopping = True
        for t in self.restarts:
            t.join()  # a restart in flight: its process is in self.procs once it returns
        (Path(self.cfg.run_dir) / SERVICES_FILE).unlink(missing_ok=True)
        for proc in reversed(self.procs):
            if proc.alive():
                _progress(f"stopping {proc.name} (pid {proc.pid})")
                code = proc.stop()
                if code not in (0, None, -signal.SIGTERM):
                    _progress(f"{proc.name} exited with code {code}; see {proc.log_path}")
        self.procs.clear()

    def wait(self) -> str:
        """Supervises until a signal arrives (returns its name): restarts what dies."""
        stopping: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            stopping.append(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        self.write_status()
        while not stopping:
            if self.supervise_once():
                self.write_status()
            time.sleep(0.5)
        return f"received {stopping[0]}"

    def supervise_once(self) -> bool:
        """One supervision pass; True when some service changed state."""
        now = time.monotonic()
        changed = False
        for i, proc in enumerate(self.procs):
            sup = self.supervised[proc.name]
            if sup.state == "starting":
                continue  # a restart thread owns it
            if sup.state == "running":
                if proc.alive():
                    if sup.in_a_row and now - sup.started > STABLE_S:
                        sup.in_a_row = 0
                    continue
                sup.last_exit = proc.popen.returncode
                delay = RESTART_BACKOFF_S[min(sup.in_a_row, len(RESTART_BACKOFF_S) - 1)]
                sup.state, sup.next_start = "restarting", now + delay
                _progress(
                    f"{proc.name} exited with code {sup.last_exit}; restarting it in {delay:.0f}s "
                    f"(restart {sup.restarts + 1}); the rest keeps serving. Log tail:\n"
                    f"{proc.log_tail(10)}"
                )
                changed = True
            elif now >= sup.next_start:
                sup.state = "starting"
                t = threading.Thread(
                    target=self._restart, args=(i, proc.name), name=f"restart-{proc.name}"
                )
                self.restarts = [r for r in self.restarts if r.is_alive()] + [t]
                t.start()
                changed = True
        return changed

    def _restart(self, index: int, name: str) -> None:
        from pdserve.procs import ProcessStartError, spawn_service, wait_ready

        sup = self.supervised[name]
        if self.stopping:
            return
        proc = spawn_service(name, sup.args, self.log_dir, env=sup.env, append=True)
        self.procs[index] = proc
        sup.restarts += 1
        sup.in_a_row += 1
        sup.started = time.monotonic()
        try:
            wait_ready(proc, self.cfg.ready_timeout_s)
        except ProcessStartError as exc:
            _progress(f"{name} did not come back: {exc}")
            sup.state = "running"  # dead: the next pass schedules another try
            return
        _progress(f"{name} restarted (pid {proc.pid}): {_endpoints(proc.info)}")
        sup.state = "running"
        self.write_status()

    def write_status(self) -> None:
        """``<run_dir>/services.json``: each service's pid, state, restarts and last exit."""
        rows = [
            {
                "name": p.name,
                "pid": p.pid,
                "state": self.supervised[p.name].state,
                "restarts": self.supervised[p.name].restarts,
                "last_exit": self.supervised[p.name].last_exit,
            }
            for p in list(self.procs)
        ]
        path = Path(self.cfg.run_dir) / SERVICES_FILE
        tmp = path.with_suffix(".tmp")
        data = {"up_pid": os.getpid(), "tls": self.cfg.tls, "services": rows}
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)


def _endpoints(info: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in info.items() if k != "service")


def _progress(msg: str) -> None:
    print(f"[pdserve up] {msg}", file=sys.stderr, flush=True)


def banner(cfg: UpConfig) -> str:
    """What ``up`` prints once every service is ready (it never prints the API key)."""
    http = f"http://{cfg.host}:{cfg.http_port}"
    grpc_addr = f"{cfg.host}:{cfg.router_port}"
    run_dir = shlex.quote(str(cfg.run_dir))
    key_file = shlex.quote(str(Path(cfg.run_dir) / API_KEY_FILE))
    status = f"pdserve status --meta {cfg.host}:{cfg.meta_port} --run-dir {run_dir}"
    if cfg.auth:
        key = f"$(cat {key_file})"
        auth_line = (
            f"  API key  {key_file}   (HTTP: Authorization: Bearer <key>; gRPC metadata: "
            "authorization: Bearer <key>)\n"
        )
        curl_key = f' -H "Authorization: Bearer {key}"'
        grpcurl_key = f' -H "authorization: Bearer {key}"'
        gen_env = f"PDSERVE_API_KEY={key} "
    else:
        auth_line = curl_key = grpcurl_key = gen_env = ""
    if cfg.tls:
        files = tls_files(cfg.run_dir, ADMIN)
        env = " ".join(f"PDSERVE_{k.upper()}={shlex.quote(v)}" for k, v in files.items())
        tls_lines = (
            f"  mutual TLS between the services (certificates: {Path(cfg.run_dir) / CERTS_DIR}); "
            "`pdserve status` below dials them as up's admin\n"
            "  identity; other clients (e.g. pdserve health) take it from the environment:\n"
            f"    export {env}\n"
        )
    else:
        tls_lines = ""
    if cfg.store_backend == "mooncake":
        store_line = (
            f"Mooncake Store (mooncake_master)  {MOONCAKE_HOST}:{cfg.master_port}   "
            "(no TLS on Mooncake's links: 127.0.0.1 only)"
        )
    else:
        store_line = f"KV store master  {cfg.host}:{cfg.master_port}"
    return f"""
pdserve is up.
  OpenAI-compatible HTTP  {http}/v1   (health: {http}/health, metrics: {http}/metrics)
  gRPC (pdserve.v1.RouterService)  {grpc_addr}
{auth_line}  meta (registry)  {cfg.host}:{cfg.meta_port}   {store_line}
{tls_lines}  logs  {Path(cfg.run_dir) / "logs"}/<service>.log      status: {status}

Try it:
  curl -s {http}/v1/completions -H 'Content-Type: application/json'{curl_key} \\
    -d '{{"model": "{cfg.model}", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}}'

  {gen_env}.venv/bin/pdserve generate --router {grpc_addr} --model {cfg.model} "Once upon a time"

  grpcurl -plaintext{grpcurl_key} -d '{{"model": "{cfg.model}", "prompt": "Once upon a time", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
    {grpc_addr} pdserve.v1.RouterService/GenerateStream

Ctrl-C stops everything.
"""


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from pdserve.devices import place_workers, visible_gpus

    gpus = visible_gpus(os.environ)
    try:
        cfg = config.from_args(UpConfig, "up", args)
        cfg.resolve(gpus)
        places = place_workers(
            cfg.workers(), engine=cfg.engine, gpus=gpus, cores=os.cpu_count() or 1
        )
    except (ConfigError, ValueError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(cfg, args.config, places)
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
    try:
        print(banner(cfg), flush=True)
        _progress(f"healthy in {time.monotonic() - t0:.1f}s")
        reason = cluster.wait()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM before wait() took over the signals
        reason = "received SIGINT"
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
