"""A pdserve cluster on real processes for the tests (``Cluster``): meta, a KV store (master
+ one node), prefill and decode workers (the torch engine on the tiny model unless told
otherwise) and the router found through meta, optionally every internal link mutual TLS; and
the calls the tests make on it (the router's stream, a worker's Prefill and Decode and its
metrics)."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from router_traces import read_router_traces

from pdserve import auth, grpcutil, identity
from pdserve.commands import certs
from pdserve.procs import ServiceProcess, free_ports, service_args, start_service
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

#: the chunk size of the workers and the router, unless a cluster's flags say otherwise
CS = 16
#: a worker call's sampling unless told otherwise: greedy, MAX tokens
MAX = 10
GREEDY = common_pb2.SamplingParams(max_tokens=MAX, temperature=0.0)


class Cluster:
    def __init__(
        self,
        log_dir: Path,
        model_dir: Path,
        *,
        decodes: int = 1,
        prefills: int = 2,
        tls: bool = False,
        worker_flags: Callable[[str, int], dict[str, object]] | None = None,
        router_flags: dict[str, object] | None = None,
        node_id: str = "",
        ha_etcd: str = "",
        master_flags: dict[str, object] | None = None,
        node_flags: dict[str, object] | None = None,
    ) -> None:
        """``tls``: every service gets its own certificate (made in ``log_dir/certs``), and
        this process an admin one, so every internal link is mutual TLS. ``worker_flags(role,
        index)``: flags that replace or add to a worker's defaults (another engine, its
        cores); ``router_flags`` likewise for the router. ``node_id``: the storage node's id,
        which names its /dev/shm files (two clusters at once need two). ``ha_etcd``: an etcd
        endpoint: two KV masters elect a leader there (``self.masters``; every client names
        both, ``self.master_address``). ``master_flags`` and ``node_flags`` replace or add to
        the KV master's and the storage node's."""
        self.ha_etcd = ha_etcd
        self.master_flags = master_flags or {}
        self.node_flags = node_flags or {}
        self.procs: list[ServiceProcess] = []
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.n_decodes = decodes
        self.n_prefills = prefills
        self.worker_flags = worker_flags or (lambda role, i: {})
        self.router_flags = router_flags or {}
        self.certs = log_dir / "certs" if tls else None
        # this test process's pid in it: another test worker may run a cluster at the same time
        self.node_id = node_id or (f"n0-tls-{os.getpid()}" if tls else f"n0-{os.getpid()}")
        if self.certs is not None:
            names = ["meta:meta", "master:master", f"node:{self.node_id}", "router:router"]
            names.append("admin:test")
            names += [f"worker:prefill-{i}" for i in range(prefills)]
            names += [f"worker:decode-{i}" for i in range(decodes)]
            certs.make(self.certs, names)
            identity.configure_files(self.files("test"))
        try:
            self._start(model_dir)
        except BaseException:
            self.close()
            raise

    def files(self, name: str) -> identity.TlsFiles:
        """The TLS files of the identity ``name`` (a tls cluster only)."""
        d = self.certs
        return identity.TlsFiles.load(f"{d}/ca.crt", f"{d}/{name}.crt", f"{d}/{name}.key")

    def _add(self, name: str, args: list[str], **kw) -> ServiceProcess:
        if self.certs is not None:
            # a node's name is its id; HA masters share the master's identity
            d, cert = self.certs, {"node": self.node_id}.get(name, name)
            cert = "master" if name.startswith("master") else cert
            args = [*args, "--tls-ca", f"{d}/ca.crt", "--tls-cert", f"{d}/{cert}.crt"]
            args += ["--tls-key", f"{d}/{cert}.key"]
        proc = start_service(name, args, self.log_dir, timeout=90, **kw)
        self.procs.append(proc)
        return proc

    def _start(self, model_dir: Path) -> None:
        self.meta = self._add("meta", service_args("meta", port=0, http_port=-1))
        meta = self.meta.info["grpc"]
        if self.ha_etcd:
            self.masters = self._ha_masters()
        else:
            state = self.log_dir / "master"
            self.masters = [
                self._add(
                    "master",
                    service_args("kvstore-master", port=0, state_dir=state, **self.master_flags),
                )
            ]
        self.master = self.masters[0]
        master = self.master_address = ",".join(m.info["grpc"] for m in self.masters)
        self.node = self._add(
            "node",
            service_args(
                "kvstore-node",
                **{
                    "master_address": master,
                    "node_id": self.node_id,
                    "segment_sizes": "64MiB",
                    "transports": "shm,tcp",
                    **self.node_flags,
                },
            ),
            env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
        )
        common = dict(
            engine="torch",
            model=model_dir,
            served_model_name="tiny",
            chunk_size=CS,
            max_model_len=2048,
            store_master=master,
            meta=meta,
            port=0,
            metrics_port=0,
        )
        self.prefills = [
            self._add(
                f"prefill-{i}",
                service_args("prefill", **{**common, **self.worker_flags("prefill", i)}),
            )
            for i in range(self.n_prefills)
        ]
        self.decodes = [
            self._add(
                f"decode-{i}",
                service_args("decode", **{**common, **self.worker_flags("decode", i)}),
            )
            for i in range(self.n_decodes)
        ]
        self.decode = self.decodes[0]
        self.router = self._add(
            "router",
            service_args(
                "router",
                **{
                    "model": model_dir,
                    "served_name": "tiny",
                    "chunk_size": CS,
                    "max_model_len": 2048,
                    "port": 0,
                    "http_port": 0,
                    "meta": meta,
                    "store_master": master,
                    "policy": "cache_aware",
                    "local_prefill_threshold": 0,
                    **self.router_flags,
                },
            ),
        )
        self.grpc = self.router.info["grpc"]
        self.http = self.router.info["http"]
        with grpcutil.sync_channel(self.grpc, public=True) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            api_key = self.router_flags.get("api_key")
            key = auth.bearer(str(api_key)) if api_key else None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                (m,) = stub.ListModels(router_pb2.ListModelsRequest(), metadata=key).models
                if m.prefill_workers == self.n_prefills and m.decode_workers == self.n_decodes:
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"router did not discover the workers: {m}")

    def _ha_masters(self) -> list[ServiceProcess]:
        """Two masters on fixed ports, the first leading (READY as a standby, then serving)."""
        out = []
        for i, port in enumerate(free_ports(2)):
            args = service_args(
                "kvstore-master", port=port, state_dir="", ha_etcd=self.ha_etcd, metrics_port=0
            )
            out.append(self._add("master" if i == 0 else f"master-{i}", args))
            if i == 0:
                deadline = time.monotonic() + 30
                while not grpcutil_ready(out[0].info["grpc"]):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the first KV master did not lead")
                    time.sleep(0.1)
        return out

    def restart(self, proc: ServiceProcess) -> ServiceProcess:
        """``proc`` (dead) started again with its arguments, as ``pdserve up`` restarts one."""
        again = start_service(proc.name, list(proc.popen.args[3:]), self.log_dir, timeout=90)
        self.procs.append(again)
        return again

    def close(self) -> None:
        if self.certs is not None:
            identity.configure_files(None)
        for proc in reversed(self.procs):
            proc.stop()
        node = getattr(self, "node", None)
        for name in node.info.get("shm_names", []) if node else []:
            Path("/dev/shm", name).unlink(missing_ok=True)

    def traces(self, *wait_for: str, timeout_s: float = 10.0) -> dict[str, dict]:
        """The router's per-request trace lines, by request id (waiting for ``wait_for``)."""
        return read_router_traces(self.router.log_path, *wait_for, timeout_s=timeout_s)


def grpcutil_ready(address: str) -> bool:
    """Whether a gRPC server answers its health check at ``address``."""
    import asyncio

    return asyncio.run(grpcutil.check_health(address, timeout=1.0))


def metric(proc: ServiceProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://{proc.info['metrics']}/metrics", timeout=5).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stream(
    cluster: Cluster, into: list | None = None, **kw
) -> list[router_pb2.GenerateStreamResponse]:
    """The router's stream for ``GenerateRequest(**kw)``; each message is appended to ``into``
    (when given, and returned) as it arrives, for a caller watching from another thread."""
    out = [] if into is None else into
    with grpcutil.sync_channel(cluster.grpc, public=True) as ch:  # the router's API: no mTLS
        stub = router_pb2_grpc.RouterServiceStub(ch)
        # wait_for_ready: on a loaded 2-core machine a fresh channel's first connection
        # attempt can time out (UNAVAILABLE, no SETTINGS frame); the RPC then waits for the
        # reconnect within its deadline, as a real client would retry
        request = router_pb2.GenerateRequest(**kw)
        for msg in stub.GenerateStream(request, timeout=120, wait_for_ready=True):
            out.append(msg)
    return out


def ids(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def greedy(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, temperature=0.0)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 * i + 5 + salt) % 500 + 5 for i in range(n)]


def stubs(proc):
    ch = grpcutil.sync_channel(proc.info["grpc"])
    return ch, engine_pb2_grpc.PrefillServiceStub(ch), engine_pb2_grpc.DecodeServiceStub(ch)


def do_prefill(proc, toks, rid, **kw) -> engine_pb2.PrefillResponse:
    ch, p, _ = stubs(proc)
    with ch:
        # wait_for_ready: a fresh channel to a worker whose cores are busy (two vLLM engines
        # on two cores) may need more than one connection attempt.
        return p.Prefill(
            engine_pb2.PrefillRequest(
                request_id=rid, model="tiny", prompt_token_ids=toks, sampling=GREEDY, **kw
            ),
            timeout=60,
            wait_for_ready=True,
        )


def do_decode(proc, toks, rid, **kw) -> list[engine_pb2.DecodeResponse]:
    ch, _, d = stubs(proc)
    with ch:
        req = engine_pb2.DecodeRequest(
            request_id=rid,
            model="tiny",
            prompt_token_ids=toks,
            sampling=kw.pop("sampling", GREEDY),
            **kw,
        )
        return list(d.Decode(req, timeout=60, wait_for_ready=True))


def tokens_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]
