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

``--kvstore-masters N`` runs N KV store masters, one leading, elected through etcd (meta's with
``meta_backend etcd``, else an etcd ``up`` runs on 127.0.0.1:etcd_port), every client naming
them all: a killed leader's successor serves every committed object
(:mod:`pdserve.commands.up_etcd`).

``--external-engine URL`` (and ``--external-prefill URL``) puts meta, the store and the router
in front of stock ``vllm serve`` engines that ``up`` does not start, instead of pdserve workers:
``up`` prints each engine's ``--kv-transfer-config`` for this store, waits for the engines'
/health and never restarts them (:mod:`pdserve.commands.up_external`).

Secure by default: the services talk mutual TLS, each with its own identity (certificates in
``<run_dir>/certs``, issued at each start by a new CA whose key stays in ``up``'s memory, valid
``cert_hours`` and renewed in place at half that; ``up`` itself, and ``pdserve status
--run-dir``, act as ``admin``), and the router requires an
API key (``<run_dir>/api_key``, mode 0600). ``--no-tls`` / ``--no-auth`` turn them off.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import config
from pdserve.config import ConfigError, help_field

if TYPE_CHECKING:
    from pdserve.identity import TlsFiles

#: Bounds of ``cert_hours``: 36 s (tests; a renewal every 18 s) to a year.
MIN_CERT_HOURS, MAX_CERT_HOURS = 0.01, 8760.0


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
    kvstore_masters: int = help_field(
        1,
        "KV store masters, 1 to 5: with 2 or more they elect a leader through etcd (meta_backend "
        "etcd: its etcd_endpoints; else an etcd up runs on 127.0.0.1:etcd_port), master i "
        "listens on master_port + i, every client names them all and follows the leader, and "
        "a killed leader's successor serves what it committed (store_backend pdserve)",
    )
    segment_size: str = help_field("2GiB", "memory each storage node contributes", metavar="SIZE")
    disk_size: str = help_field(
        "8GiB",
        "each storage node's disk tier under <run_dir>/kvdisk (a sparse file: space is taken as "
        "chunks move down; at most half the free space there; 0 = no disk tier)",
        metavar="SIZE",
    )
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
    model: str = help_field(
        "smollm2",
        "model: 'smollm2' (= HuggingFaceTB/SmolLM2-135M-Instruct, shipped), 'tiny', a model "
        "directory, or a Hugging Face id (from the Hugging Face cache, downloaded when missing)",
    )
    models: list[str] = help_field(
        [],
        "several models behind the one router, each with workers of its own: SERVED=MODEL or "
        "MODEL each, comma-separated (--model repeated says the same), the first the default; "
        "prefill_workers and decode_workers then count per model, auto giving each model "
        "min(cores, 8) // models workers, at least one ([] = model alone; "
        "pdserve/commands/up_models.py)",
        metavar="[SERVED=]MODEL,...",
    )
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
    etcd_port: int = help_field(
        50090,
        "client port of the etcd up runs for kvstore_masters >= 2 when meta_backend is memory "
        "(127.0.0.1 only, peer port etcd_port + 1, data in <run_dir>/etcd)",
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
        "mutual TLS between the services; certificates are made in <run_dir>/certs at each "
        "start by `pdserve certs`'s code from a new CA whose key never touches the disk (the "
        "services cannot issue identities; engines outside up restart with it)",
    )
    cert_hours: float = help_field(
        24.0,
        "hours each certificate up issues is valid; up renews them in place at half their "
        "life (services load the new files, connections up stay up) and a new start makes a "
        f"new CA; {MIN_CERT_HOURS} to {MAX_CERT_HOURS}",
    )
    isolate_services: bool = help_field(
        False,
        "run each service as a Unix user of its own (needs root): a service then reads only "
        "its own private key and state, not up's admin key nor another service's key "
        "(pdserve/commands/up_isolation.py)",
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
    external_engine: list[str] = help_field(
        [],
        "base URLs (http://HOST:PORT or https://) of OpenAI-compatible `vllm serve` engines up "
        "does not start, each with pdserve's connector (kv_both): up then starts no pdserve "
        "workers, only meta, the store and the router, which routes to these as workers that "
        "prefill and decode; up prints the --kv-transfer-config each needs, waits for their "
        "/health, never restarts them. Comma-separated",
        metavar="URL,...",
    )
    external_prefill: list[str] = help_field(
        [],
        "with external_engine, P/D between stock engines: these URLs are the router's prefill "
        "workers (the prompt's KV goes through the store), the external_engine ones its decode "
        "workers (which still run short prompts alone). A separate list rather than a role "
        "inside each URL, as the router's own --prefill / --decode. Comma-separated",
        metavar="URL,...",
    )
    engine_kv_events: list[str] = help_field(
        [],
        "URL=ENDPOINT[+REPLAY] per external engine that publishes vLLM KV events (the "
        "endpoint and replay_endpoint of its --kv-events-config, e.g. "
        "http://127.0.0.1:8100=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558), handed to the "
        "router's --engine-kv-events for cache-aware placement. Comma-separated",
        metavar="URL=ENDPOINT,...",
    )
    kv_dtype: str = help_field(
        "auto",
        "KV dtype, part of the chunk keys: auto, float32, bfloat16, float16. With "
        "external_engine the router keys prompts with it (it cannot ask stock engines): auto = "
        "bfloat16, what the stock connector derives for vLLM's default --dtype auto with a "
        "float32 or bfloat16 model (SmolLM2 included; vLLM downcasts float32 to bfloat16 on "
        "CPUs and bf16 GPUs); set it to the engines' --kv-cache-dtype or --dtype otherwise. "
        "pdserve workers get it as their --kv-dtype unless auto (their own default)",
    )

    def validate(self) -> None:
        if self.isolate_services and self.store_backend == "mooncake":
            raise ConfigError(
                "isolate_services runs pdserve's own services as users of their own; "
                "store_backend mooncake's processes are not (use store_backend pdserve)"
            )
        if not MIN_CERT_HOURS <= self.cert_hours <= MAX_CERT_HOURS:
            raise ConfigError(
                f"cert_hours must be {MIN_CERT_HOURS} to {MAX_CERT_HOURS}, got {self.cert_hours}"
            )
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
        from pdserve.commands import up_etcd, up_external, up_models

        up_models.validate(self)
        up_etcd.validate(self)
        up_external.validate(self)
        if self.api_key and not self.auth:
            raise ConfigError(
                "api_key is set but auth is off: unset api_key (PDSERVE_UP_API_KEY) or turn auth on"
            )
        from pdserve.identity import _is_loopback

        if self.tls and not self.auth and not _is_loopback(self.host):
            raise ConfigError(
                f"host {self.host!r} is reachable from other hosts, and there the services' "
                "metrics ports take up's API key, which auth off does not make: turn auth on "
                "or bind 127.0.0.1"
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

    def master_addresses(self) -> list[str]:
        """Each KV store master's host:port, the first leading at start (store_backend
        mooncake: mooncake_master's, on 127.0.0.1)."""
        host = MOONCAKE_HOST if self.store_backend == "mooncake" else self.host
        return [f"{host}:{self.master_port + i}" for i in range(self.kvstore_masters)]

    def mooncake_metadata(self) -> str:
        """The metadata server the Mooncake clients get (store_backend mooncake)."""
        if self.store_metadata_server == "meta":
            return f"http://{MOONCAKE_HOST}:{self.meta_http_port}/metadata"
        return self.store_metadata_server

    def resolve(self, gpus: Sequence[str] | None = None) -> None:
        """Replaces the auto values (engine, topology) with what they mean on this machine,
        whose visible GPUs are ``gpus`` (default :func:`pdserve.devices.visible_gpus`): one
        worker per GPU (vLLM), else per core, at most 8."""
        if gpus is None:
            from pdserve.devices import visible_gpus

            gpus = visible_gpus(os.environ)
        if self.engine == "auto":
            self.engine = "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
        if self.external_engine:  # the external engines are the workers
            self.prefill_workers = self.decode_workers = 0
            return
        if self.prefill_workers < 0:
            self.prefill_workers = 0
        if self.decode_workers == 0:  # per model: the units shared among the models
            units = len(gpus) if gpus and self.engine == "vllm" else os.cpu_count() or 1
            share = max(min(units, 8) // max(len(self.models), 1), 1)
            self.decode_workers = share if self.prefill_workers == 0 else 1

    def workers(self) -> list[tuple[str, int]]:
        """(role, index) of every worker, in start order (after :meth:`resolve`): each
        model's ``prefill_workers`` and ``decode_workers`` (:mod:`~pdserve.commands.up_models`)."""
        n = max(len(self.models), 1)
        return [("prefill", i) for i in range(self.prefill_workers * n)] + [
            ("decode", i) for i in range(self.decode_workers * n)
        ]


#: Where ``up`` binds Mooncake (store_backend mooncake), and the ``host`` values it accepts then.
MOONCAKE_HOST = "127.0.0.1"
LOOPBACK_OR_ANY = ("127.0.0.1", "localhost", "0.0.0.0", "::")
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


def banner(cfg: UpConfig, model: str = "") -> str:
    """What ``up`` prints once every service is ready (it never prints the API key); ``model``
    is the name requests use (default: cfg.model; with external engines the name they serve)."""
    from pdserve.commands import up_models

    model = model or cfg.model
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
    elif cfg.kvstore_masters > 1:
        from pdserve.commands.up_etcd import etcd_endpoints

        store_line = (
            f"KV store masters  {','.join(cfg.master_addresses())}   (one leads, elected "
            f"through etcd {','.join(etcd_endpoints(cfg))})"
        )
    else:
        store_line = f"KV store master  {cfg.host}:{cfg.master_port}"
    external = ""
    if cfg.external_engine:
        from pdserve.commands.up_external import EXTERNAL_FILE, instructions

        external = (
            "  external engines (up neither starts nor restarts them), each with its "
            f"--kv-transfer-config (also in {Path(cfg.run_dir) / EXTERNAL_FILE}):\n"
            f"{instructions(cfg)}\n"
        )
    sd_line = ""
    if cfg.meta_http_port >= 0:
        from pdserve.identity import _is_loopback

        scheme = "https" if cfg.tls else "http"
        sd_line = (
            f"  Prometheus targets (http_sd_configs)  {scheme}://{cfg.host}:{cfg.meta_http_port}"
            "/prometheus/targets\n"
        )
        if cfg.tls and not _is_loopback(cfg.host):
            sd_line += (
                "    (beyond loopback their /metrics take the API key: "
                f"authorization: {{credentials_file: {key_file}}})\n"
            )
    return f"""
pdserve is up.
  OpenAI-compatible HTTP  {http}/v1   (health: {http}/health, metrics: {http}/metrics)
{up_models.banner_line(cfg)}  gRPC (pdserve.v1.RouterService)  {grpc_addr}
{auth_line}  meta (registry)  {cfg.host}:{cfg.meta_port}   {store_line}
{sd_line}{tls_lines}{external}  logs  {Path(cfg.run_dir) / "logs"}/<service>.log      status: {status}

Try it:
  curl -s {http}/v1/completions -H 'Content-Type: application/json'{curl_key} \\
    -d '{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}}'

  {gen_env}.venv/bin/pdserve generate --router {grpc_addr} --model {model} "Once upon a time"

  grpcurl -plaintext{grpcurl_key} -d '{{"model": "{model}", "prompt": "Once upon a time", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
    {grpc_addr} pdserve.v1.RouterService/GenerateStream

Ctrl-C stops everything.
"""


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from pdserve.commands import up_models
    from pdserve.commands.up_cluster import Cluster, progress
    from pdserve.commands.up_external import model_explicit
    from pdserve.errors import FailedPrecondition

    try:
        up_models.fold_flag(args)
        cfg = config.from_args(UpConfig, "up", args)
        cfg.resolve()
        # the models first (names, folders, Hugging Face ids): refused before anything starts
        explicit = model_explicit(args)
        if explicit or not cfg.external_engine:  # else the model is the external engines'
            up_models.resolve_all(cfg)
        # places the workers: ValueError when it cannot
        cluster = Cluster(cfg, args.config, explicit_model=explicit)
    except (ConfigError, ValueError, FailedPrecondition) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
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
        print(banner(cfg, cluster.model_name), flush=True)
        progress(f"healthy in {time.monotonic() - t0:.1f}s")
        reason = cluster.wait()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM before wait() took over the signals
        reason = "received SIGINT"
    progress(f"shutting down: {reason}")
    cluster.stop()
    return 0 if reason.startswith("received") else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a whole cluster on this machine (meta, KV store, workers, router)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # up_models' --model replaces the config's
    )
    config.add_arguments(p, UpConfig)
    from pdserve.commands import up_models

    up_models.add_flag(p)
    p.set_defaults(func=run)
