"""What ``pdserve up`` is asked for (:class:`UpSettings`: its ``up`` config section, every field
with its help) and the run dir's layout its parts share (file names, TLS files, the admin
identity), with no checks that need the parts: the leaf that ``up_models``, ``up_etcd``,
``up_external``, ``up_secrets`` and ``up_cluster`` take their config type from, so that
:class:`pdserve.commands.up.UpConfig` (these fields and their validation, which asks those
parts) imports them without an import circle."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.config_fields import help_field

if TYPE_CHECKING:
    from pdserve.identity import TlsFiles

#: Bounds of ``cert_hours``: 36 s (tests; a renewal every 18 s) to a year.
MIN_CERT_HOURS, MAX_CERT_HOURS = 0.01, 8760.0


@dataclass
class UpSettings:
    """The fields of ``pdserve up`` (config section ``up``) and what derives from them alone;
    :class:`pdserve.commands.up.UpConfig` adds the validation."""

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
    isolate_services: str = help_field(
        "auto",
        "run each service as a Unix user of its own, so that a service reads only its own "
        "private key and state, not up's admin key nor another service's key: auto (as root "
        "whenever the services can reach the interpreter, the package, the models and the run "
        "dir; else the banner says why not and how to fix it), on (refuse to start otherwise) "
        "or off (pdserve/commands/up_isolation.py)",
        metavar="auto|on|off",
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


def progress(msg: str) -> None:
    """One line of ``up``'s progress on stderr."""
    print(f"[pdserve up] {msg}", file=sys.stderr, flush=True)
