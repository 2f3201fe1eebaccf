"""``pdserve up``: a whole cluster on one machine with embedded defaults.

Starts, in order, meta (memory backend, or etcd), the KV store master, the storage nodes, the
prefill and decode workers (in parallel) and the router; waits until each is healthy; prints
the endpoints and a ready-to-paste example; streams each service's log to its own file. It
then supervises: a service that dies is logged and restarted (at once, then with backoff if it
dies again: 1 s doubling to 30 s, reset once it has run for a minute) while the rest keeps
serving, and
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
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import config
from pdserve.commands.up_settings import (
    ADMIN,
    API_KEY_FILE,
    CERTS_DIR,
    LOOPBACK_OR_ANY,
    MAX_CERT_HOURS,
    MIN_CERT_HOURS,
    MOONCAKE_HOST,
    SERVICES_FILE,
    UpSettings,
    admin_tls,
    progress,
    tls_files,
)
from pdserve.config import ConfigError

if TYPE_CHECKING:
    from pdserve.commands.up_isolation import Isolation

#: The command and its config; the run dir's layout (defined in ``up_settings``) stays
#: importable from here as it always was (``pdserve status``, the kvstore admin commands).
__all__ = [
    "ADMIN",
    "API_KEY_FILE",
    "CERTS_DIR",
    "SERVICES_FILE",
    "UpConfig",
    "add_parser",
    "admin_tls",
    "banner",
    "run",
    "tls_files",
]


@dataclass
class UpConfig(UpSettings):
    """``pdserve up``'s configuration: :class:`UpSettings` checked, by up's parts too."""

    def validate(self) -> None:
        from pdserve.commands.up_isolation import mode

        self.isolate_services = mode(self.isolate_services)
        if self.isolate_services == "on" and self.store_backend == "mooncake":
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
        from pdserve.identity import is_loopback

        if self.tls and not self.auth and not is_loopback(self.host):
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


def banner(cfg: UpConfig, model: str = "", isolation: Isolation | None = None) -> str:
    """What ``up`` prints once every service is ready (it never prints the API key); ``model``
    is the name requests use (default: cfg.model; with external engines the name they serve);
    ``isolation``: which users the services run as (after its check)."""
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
        from pdserve.identity import is_loopback

        scheme = "https" if cfg.tls else "http"
        sd_line = (
            f"  Prometheus targets (http_sd_configs)  {scheme}://{cfg.host}:{cfg.meta_http_port}"
            "/prometheus/targets\n"
        )
        if cfg.tls and not is_loopback(cfg.host):
            sd_line += (
                "    (beyond loopback their /metrics take the API key: "
                f"authorization: {{credentials_file: {key_file}}})\n"
            )
    users = ""
    if isolation is not None and isolation.on:
        users = "  services run as Unix users of their own: each reads only its own key\n"
    elif isolation is not None and isolation.note:
        users = f"  NOT isolated: {isolation.note}\n"
    return f"""
pdserve is up.
  OpenAI-compatible HTTP  {http}/v1   (health: {http}/health, metrics: {http}/metrics)
{up_models.banner_line(cfg)}  gRPC (pdserve.v1.RouterService)  {grpc_addr}
{auth_line}  meta (registry)  {cfg.host}:{cfg.meta_port}   {store_line}
{sd_line}{tls_lines}{users}{external}  logs  {Path(cfg.run_dir) / "logs"}/<service>.log      status: {status}

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
    from pdserve.commands.up_cluster import Cluster
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
        cluster.write_status()  # `pdserve status` works once the banner is out
        print(banner(cfg, cluster.model_name, cluster.isolation), flush=True)
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
