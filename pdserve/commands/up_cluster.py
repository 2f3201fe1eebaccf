"""The processes of one ``pdserve up`` (:mod:`pdserve.commands.up`): started in order and waited for,
supervised (a service that dies is restarted with backoff while the rest keeps serving, and
``<run_dir>/services.json`` says what runs), and stopped in reverse order. External engines
(:mod:`pdserve.commands.up_external`) are waited for but never started, stopped or restarted:
they are not among the processes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.commands import up_etcd, up_external, up_models
from pdserve.commands.up_isolation import Isolation
from pdserve.commands.up_secrets import UpSecrets
from pdserve.commands.up_settings import (
    ADMIN,
    MOONCAKE_HOST,
    SERVICES_FILE,
    UpSettings,
    progress,
)
from pdserve.commands.up_supervise import RESTART_BACKOFF_S, STABLE_S, SUPERVISE_S, Supervised
from pdserve.devices import Placement, place_workers, visible_gpus
from pdserve.sizes import parse_size

log = logging.getLogger(__name__)

#: Services started without ``--config`` (they are not pdserve config sections).
NO_CONFIG = ("mooncake-", "etcd")
MOONCAKE_SECURITY_NOTE = (
    "store backend mooncake: Mooncake's own links (mooncake_master RPC, Transfer Engine data "
    "and handshakes) carry no TLS and no authentication, unlike pdserve's services (mutual "
    f"TLS); up binds them to {MOONCAKE_HOST}, so only local processes reach the KV cache"
)


@dataclass
class Cluster:
    """The services of one ``pdserve up``, in start order."""

    cfg: UpSettings
    config_path: str | None
    #: each worker's share of the machine, in ``cfg.workers()`` order (:mod:`pdserve.devices`;
    #: made from this machine's visible GPUs, else its cores, before anything starts)
    places: Sequence[Placement] = ()
    procs: list = field(default_factory=list)
    supervised: dict[str, Supervised] = field(default_factory=dict)
    stopping: bool = False
    #: This cluster's restart threads (the finished ones are dropped as new ones start).
    restarts: list[threading.Thread] = field(default_factory=list)
    #: Whether the user chose cfg.model (else external engines say which model they serve).
    explicit_model: bool = True
    #: The name requests use for the model (set by start()).
    model_name: str = ""
    #: The certificates (issued, renewed) and the API key file of this run.
    creds: UpSecrets = field(init=False)
    #: The user each service runs as (isolate_services).
    isolation: Isolation = field(init=False)

    def __post_init__(self) -> None:
        """Places the workers (ValueError when this machine cannot hold them, e.g. more vLLM
        workers than GPUs), so a start that cannot succeed fails before anything starts."""
        self.isolation = Isolation(self.cfg.isolate_services, self.cfg.run_dir)
        self.creds = UpSecrets(self.cfg, self.isolation)
        if not self.places:
            c = self.cfg
            self.places = place_workers(
                c.workers(),
                engine=c.engine,
                gpus=visible_gpus(os.environ),
                cores=os.cpu_count() or 1,
            )

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
            user, home = self.isolation.spawn(name, full)
            env |= home
            started.append(spawn_service(name, full, self.log_dir, env=env, user=user))
            self.supervised[name] = Supervised(full, env, user=user)
        self.procs.extend(started)
        for proc in started:
            progress(f"waiting for {proc.name} (log: {proc.log_path})")
            wait_ready(proc, self.cfg.ready_timeout_s)
            if proc.info.get("standby"):  # a KV master that binds nothing until it leads
                progress(f"{proc.name} stands by: {_endpoints(proc.info)}")
                continue
            public = proc.name == "router"  # its gRPC port is the public API, no client certs
            if "grpc" in proc.info and not asyncio.run(
                grpcutil.check_health(proc.info["grpc"], public=public)
            ):
                raise RuntimeError(f"{proc.name} is up but its gRPC health check fails")
            progress(f"{proc.name} ready: {_endpoints(proc.info)}")
        return started

    def start(self) -> None:
        from pdserve.procs import service_args

        c = self.cfg
        mooncake = c.store_backend == "mooncake"
        meta = f"{c.host}:{c.meta_port}"
        master = ",".join(c.master_addresses())  # HA: every master's (up_etcd)
        etcd = ",".join(c.etcd_endpoints) if c.meta_backend == "etcd" else None
        # unique per cluster: node ids name /dev/shm segments, so two `pdserve up` on one host
        # must not share them (and a node's certificate names its node id)
        node_ids = [] if mooncake else [f"node-{i}-{c.master_port}" for i in range(c.storage_nodes)]
        workers = c.workers()
        self.model_name = up_models.specs(c)[0].name
        if mooncake:
            from pdserve.store.mooncake_backend import available

            if not available():
                raise RuntimeError(
                    "store_backend mooncake needs the mooncake wheel (pip install "
                    "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1): "
                    "mooncake.store does not import"
                )
            progress(MOONCAKE_SECURITY_NOTE)
        up_etcd.check(c)
        # the workers' model folders must be theirs to read too (an external engine's are not)
        models = up_models.resolve_all(c) if workers else []
        self.isolation.check(models, c.store_backend)
        self.creds.secure(
            [
                "meta:meta",
                *([] if mooncake else ["master:kvstore-master"]),
                *(f"node:{n}" for n in node_ids),
                *(f"worker:{role}-{i}" for role, i in workers),
                *(f"worker:{e.cert}" for e in up_external.engines(c)),
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
            metrics_port=0,  # a free port, found through meta's /prometheus/targets
            # the Mooncake endpoint only for Transfer Engines that use it (None: the config's)
            http_metadata=True if mooncake and c.store_metadata_server == "meta" else None,
            **self.creds.tls("meta"),
            **self.creds.metrics(),
        )
        if up_etcd.embedded(c):  # what the KV masters elect a leader through
            if not c.tls:
                progress(up_etcd.PLAIN_NOTE)
            self.isolation.give(up_etcd.etcd_data_dir(c), "etcd")
            self._start([up_etcd.etcd_spec(c)])
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
        router: dict[str, object] = {}
        if c.external_engine:  # the store is up: the engines can start now, and are waited for
            router, self.model_name = up_external.await_engines(c, self.explicit_model, progress)
        self._start_workers_and_router(meta, master, workers, store, router)

    def _start_pdserve_store(self, meta: str, master: str, node_ids: list[str]) -> None:
        """pdserve's own KV store: its master, then the storage nodes."""
        from pdserve.procs import service_args

        c = self.cfg
        masters = up_etcd.master_specs(
            c, meta, {**self.creds.tls("kvstore-master"), **self.creds.metrics()}
        )
        if len(masters) == 1:  # its SQLite state dir
            self.isolation.give(up_etcd.master_state_dir(c), "kvstore-master")
        (first,) = self._start(masters[:1])
        if len(masters) > 1:  # HA: the first leads before the standbys and the nodes start
            up_etcd.wait_leading(first, c.ready_timeout_s, progress)
            self._start(masters[1:])
        nodes = [
            (
                f"kvstore-node-{i}",
                service_args(
                    "kvstore-node",
                    master_address=master,
                    node_id=node_id,
                    segment_sizes=c.segment_size,
                    **self._disk_tier(node_id),
                    host=c.host,
                    meta=meta,
                    metrics_port=0,
                    **self.creds.tls(node_id),
                    **self.creds.metrics(),
                ),
            )
            for i, node_id in enumerate(node_ids)
        ]
        self._start(nodes)

    def _disk_tier(self, node_id: str) -> dict[str, object]:
        """A storage node's disk tier flags: ``<run_dir>/kvdisk``, with isolate_services a
        folder of its own there that only it can enter."""
        folder = Path(self.cfg.run_dir) / "kvdisk"
        if self.isolation.on:
            folder /= node_id
            self.isolation.give(folder, node_id)
        return disk_tier(folder, self.cfg.disk_size)

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
        self,
        meta: str,
        master: str,
        workers: list[tuple[str, int]],
        store: dict[str, str],
        external: dict[str, object],
    ) -> None:
        """The workers (none with external engines), then the router; ``external``: the
        router's flags for external engines."""
        from pdserve.procs import service_args

        c = self.cfg
        places = self.places
        # pdserve workers get up's kv_dtype only when set (auto: their own default)
        kv_dtype = c.kv_dtype if c.kv_dtype != "auto" else None
        self._start(
            [
                (
                    f"{role}-{i}",
                    service_args(
                        role,
                        engine=c.engine,
                        **up_models.worker_flags(c, role, i),
                        chunk_size=c.chunk_size,
                        kv_compression=c.kv_compression,
                        kv_dtype=kv_dtype,
                        store_master=master,
                        **store,
                        meta=meta,
                        host=c.host,
                        instance_id=f"{role}-{i}",
                        # a core of its own on a CPU (vLLM pins its OpenMP threads), a GPU elsewhere
                        vllm_cpu_cores=place.cpu_cores,
                        **self.creds.tls(f"{role}-{i}"),
                        **self.creds.metrics(),
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
            **{**up_models.router_flags(c), "chunk_size": c.chunk_size, **external},
            api_key_file=self.creds.key_file(),
            **self.creds.tls("router"),
        )
        (router,) = self._start([("router", router_args)])
        self._wait_for_workers(router.info["grpc"])

    def _wait_for_workers(self, router: str) -> None:
        """Ready means the router routes: it must see every worker ``up`` started (or every
        external engine)."""
        from pdserve import grpcutil
        from pdserve.auth import bearer
        from pdserve.v1 import router_pb2, router_pb2_grpc

        c = self.cfg
        roles = [role for role, _ in c.workers()]
        want = (
            (len(c.external_prefill), len(c.external_engine))
            if c.external_engine
            else (roles.count("prefill"), roles.count("decode"))
        )
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
        self.creds.stop()
        for t in self.restarts:
            t.join()  # a restart in flight: its process is in self.procs once it returns
        (Path(self.cfg.run_dir) / SERVICES_FILE).unlink(missing_ok=True)
        for proc in reversed(self.procs):
            if proc.alive():
                progress(f"stopping {proc.name} (pid {proc.pid})")
                code = proc.stop()
                if code not in (0, None, -signal.SIGTERM):
                    progress(f"{proc.name} exited with code {code}; see {proc.log_path}")
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
            time.sleep(SUPERVISE_S)
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
                proc.stop()  # what is left of its process group, and the shared memory it left
                delay = RESTART_BACKOFF_S[min(sup.in_a_row, len(RESTART_BACKOFF_S) - 1)]
                sup.state, sup.next_start = "restarting", now + delay
                progress(
                    f"{proc.name} exited with code {sup.last_exit}; restarting it in {delay:g} s "
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
        proc = spawn_service(name, sup.args, self.log_dir, env=sup.env, append=True, user=sup.user)
        self.procs[index] = proc
        sup.restarts += 1
        sup.in_a_row += 1
        sup.started = time.monotonic()
        try:
            wait_ready(proc, self.cfg.ready_timeout_s)
        except ProcessStartError as exc:
            progress(f"{name} did not come back: {exc}")
            sup.state = "running"  # dead: the next pass schedules another try
            return
        progress(f"{name} restarted (pid {proc.pid}): {_endpoints(proc.info)}")
        sup.state = "running"
        self.write_status()

    def write_status(self) -> None:
        """``<run_dir>/services.json``: each service's pid, state, restarts and last exit,
        and meta's address (what ``pdserve status --run-dir`` dials)."""
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
        data = {
            "up_pid": os.getpid(),
            "tls": self.cfg.tls,
            "meta": f"{self.cfg.host}:{self.cfg.meta_port}",
            "services": rows,
        }
        if self.cfg.kvstore_masters > 1:  # HA: which master is where (`pdserve status`)
            data["kvstore_masters"] = up_etcd.masters(self.cfg)
        if self.cfg.external_engine:  # not supervised: up neither starts nor restarts them
            data["external_engines"] = [
                {"url": e.url, "role": e.role} for e in up_external.engines(self.cfg)
            ]
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)


def _endpoints(info: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in info.items() if k != "service")


def disk_tier(directory: Path, size: str) -> dict[str, object]:
    """The ``disk_path`` / ``disk_size`` flags of up's storage nodes: ``size`` in
    ``directory``, at most half the free space there (sparse files: the space is taken as
    chunks move down); none for ``0`` or a directory in memory (tmpfs)."""
    from pdserve.store.segment import memory_backed

    want = parse_size(size, what="disk_size", minimum=0)
    if not want:
        return {}
    directory.mkdir(parents=True, exist_ok=True)
    if memory_backed(directory):
        log.warning("%s is in memory (tmpfs): storage nodes run without a disk tier", directory)
        return {}
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize // 2
    if room < want:
        log.warning(
            "disk tier: %d MiB asked, %d MiB is half the free space in %s; using that",
            want >> 20,
            room >> 20,
            directory,
        )
    got = min(want, room) // (1 << 20) * (1 << 20)
    return {"disk_path": directory.resolve(), "disk_size": f"{got >> 20}MiB"} if got else {}
