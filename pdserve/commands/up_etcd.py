"""``pdserve up --kvstore-masters N``: N KV store masters, one leading, elected through etcd
(``services/kvstore/master/ha.py``). N = 1 (the default) is the single master with its SQLite
state dir.

With N >= 2:

- etcd: with ``meta_backend: etcd`` the masters use meta's ``etcd_endpoints``; else ``up``
  runs one etcd member of its own (``pdserve etcd``, service ``etcd``) on
  127.0.0.1:``etcd_port`` (peer port ``etcd_port + 1``), its data in ``<run_dir>/etcd``,
  started first and stopped last, supervised like the rest, on loopback only (every master
  runs on this host). With TLS on (the default) its client and peer links are TLS and take
  only certificates of a CA of its own (``<run_dir>/certs/etcd``, its key in up's memory like
  the cluster CA's, renewed alike) whose only client certificate is the masters': no other
  service's certificate, and no local process without one, reaches the masters' records.
  With ``meta_backend: etcd`` the masters reach meta's etcd as the config's
  ``kvstore-master`` section says (``ha_etcd_ca``, ``ha_etcd_cert``, ``ha_etcd_user``...).
- masters ``kvstore-master-0`` .. ``-N-1`` on ``master_port + i``, each with ``--ha-etcd``
  and no state dir (the committed objects live in etcd), all with one certificate identity,
  ``master:kvstore-master``: meta lets only the identity that registered the
  ``kvstore-master`` instance register it again, and each new leader does. The first starts
  alone and is waited for until it leads (its gRPC health passes), then the standbys start
  (their READY line says ``standby``; they bind nothing), then the storage nodes.
- clients (nodes, workers, the router, external engines' ``master_address``) name every
  master, ``host:p0,host:p1``, and follow the leader (``pdserve/failover.py``);
  ``services.json`` lists them and ``pdserve status`` shows which one leads.
- a killed leader: a standby takes over once its lease (2 s) ends, and ``up`` restarts the
  dead one, which comes back as a standby; so does a leader that lost its lease (it exits
  with status 75).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.commands.up_settings import CERTS_DIR, UpSettings
from pdserve.config import ConfigError

if TYPE_CHECKING:
    from pdserve.procs import ServiceProcess

#: Most masters ``up`` runs (one leads; the rest only wait).
MAX_MASTERS = 5
#: Where up's own etcd listens.
ETCD_HOST = "127.0.0.1"
#: The folder (under the run dir's certificates) of the CA only up's etcd trusts.
ETCD_CERTS = "etcd"
#: Its identities: etcd's own, and the one every KV master presents to it.
ETCD_SERVER, ETCD_CLIENT = "meta:etcd", "master:kvstore-master"
PLAIN_NOTE = (
    f"the KV masters elect their leader and keep the objects' records in an etcd on {ETCD_HOST} "
    "without TLS or authentication (tls is off): every local process reaches it"
)


def etcd_data_dir(cfg: UpSettings) -> Path:
    """Where up's own etcd keeps its data (kept across runs)."""
    return (Path(cfg.run_dir) / "etcd").resolve()


def master_state_dir(cfg: UpSettings) -> Path:
    """The single master's SQLite state dir (HA masters keep their state in etcd)."""
    return Path(cfg.run_dir) / "kvstore-master"


def etcd_tls(cfg: UpSettings, identity: str) -> tuple[str, ...]:
    """(CA, certificate, key) paths of ``identity`` (ETCD_SERVER or ETCD_CLIENT) under the
    etcd CA; () when up runs no etcd or TLS is off."""
    if not (embedded(cfg) and cfg.tls):
        return ()
    d = (Path(cfg.run_dir) / CERTS_DIR / ETCD_CERTS).resolve()
    name = identity.partition(":")[2]
    return str(d / "ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key")


def validate(cfg: UpSettings) -> None:
    """The kvstore_masters and etcd_port fields, and what they exclude."""
    n = cfg.kvstore_masters
    if not 1 <= n <= MAX_MASTERS:
        raise ConfigError(f"kvstore_masters must be 1 to {MAX_MASTERS}, got {n}")
    if n == 1:
        return
    if cfg.store_backend != "pdserve":
        raise ConfigError(
            f"kvstore_masters {n} needs store_backend pdserve (got {cfg.store_backend!r}): "
            "the masters that elect a leader through etcd are pdserve's"
        )
    last = cfg.master_port + n - 1
    if cfg.master_port <= 0 or last > 65535:
        raise ConfigError(
            f"kvstore_masters {n}: masters listen on master_port .. master_port + {n - 1}, "
            f"which must be ports 1 to 65535 (master_port {cfg.master_port})"
        )
    taken = {
        "meta_port": cfg.meta_port,
        "router_port": cfg.router_port,
        "http_port": cfg.http_port,
    }
    if cfg.meta_http_port >= 0:
        taken["meta_http_port"] = cfg.meta_http_port
    if embedded(cfg):
        if not 1 <= cfg.etcd_port < 65535:
            raise ConfigError(f"etcd_port must be 1 to 65534, got {cfg.etcd_port}")
        for name, port in taken.items():
            if port in (cfg.etcd_port, cfg.etcd_port + 1):
                raise ConfigError(
                    f"{name} {port} is up's etcd's port (etcd_port {cfg.etcd_port}, its peer "
                    f"port {cfg.etcd_port + 1}): pick another etcd_port"
                )
        taken |= {"etcd_port": cfg.etcd_port, "etcd_port + 1 (its peer port)": cfg.etcd_port + 1}
    for name, port in taken.items():
        if cfg.master_port <= port <= last:
            raise ConfigError(
                f"{name} {port} is among the masters' ports {cfg.master_port}..{last} "
                f"(master_port + 0 .. {n - 1} for kvstore_masters {n}): move one of them"
            )


def embedded(cfg: UpSettings) -> bool:
    """Whether ``up`` runs an etcd of its own (HA masters, meta without etcd)."""
    return cfg.kvstore_masters > 1 and cfg.meta_backend != "etcd"


def etcd_endpoints(cfg: UpSettings) -> list[str]:
    """The etcd the masters elect through: meta's, else up's own."""
    return list(cfg.etcd_endpoints) if cfg.meta_backend == "etcd" else [etcd_address(cfg)]


def etcd_address(cfg: UpSettings) -> str:
    return f"{ETCD_HOST}:{cfg.etcd_port}"


def check(cfg: UpSettings) -> None:
    """RuntimeError (what to install) when ``up`` must run etcd and no binary is there."""
    from pdserve.commands.etcd import MISSING, binary

    if embedded(cfg) and binary() is None:
        raise RuntimeError(f"kvstore_masters {cfg.kvstore_masters} runs an etcd: {MISSING}")


def etcd_spec(cfg: UpSettings) -> tuple[str, list[str]]:
    """(name, args) of up's own etcd (:mod:`pdserve.commands.etcd`)."""
    from pdserve.procs import service_args

    tls = dict(zip(("tls_ca", "tls_cert", "tls_key"), etcd_tls(cfg, ETCD_SERVER), strict=False))
    return (
        "etcd",
        service_args(
            "etcd",
            data_dir=etcd_data_dir(cfg),
            host=ETCD_HOST,
            port=cfg.etcd_port,
            peer_port=cfg.etcd_port + 1,
            **tls,
        ),
    )


def masters(cfg: UpSettings) -> dict[str, str]:
    """Each KV store master's service name and address, the one to lead first."""
    addresses = cfg.master_addresses()
    if len(addresses) == 1:
        return {"kvstore-master": addresses[0]}
    return {f"kvstore-master-{i}": a for i, a in enumerate(addresses)}


def master_specs(
    cfg: UpSettings, meta: str, flags: dict[str, object]
) -> list[tuple[str, list[str]]]:
    """(name, args) of each KV store master, the one to lead first; ``flags``: the TLS and
    metrics-key flags every master gets (one identity for all)."""
    from pdserve.procs import service_args

    if cfg.kvstore_masters == 1:
        state = master_state_dir(cfg)
        args = service_args(
            "kvstore-master",
            host=cfg.host,
            port=cfg.master_port,
            state_dir=state,
            meta=meta,
            **flags,
        )
        return [("kvstore-master", args)]
    etcd = ",".join(etcd_endpoints(cfg))
    keys = ("ha_etcd_ca", "ha_etcd_cert", "ha_etcd_key")
    tls = dict(zip(keys, etcd_tls(cfg, ETCD_CLIENT), strict=False))
    return [
        (
            name,
            service_args(
                "kvstore-master",
                host=cfg.host,
                port=int(address.rpartition(":")[2]),
                state_dir="",
                ha_etcd=etcd,
                meta=meta,
                **tls,
                **flags,
            ),
        )
        for name, address in masters(cfg).items()
    ]


def wait_leading(proc: ServiceProcess, timeout_s: float, progress: Callable[[str], None]) -> None:
    """Returns once master ``proc`` (READY as a standby) leads: its gRPC health passes.
    RuntimeError when it exits or ``timeout_s`` passes first."""
    from pdserve import grpcutil

    address = proc.info["grpc"]
    progress(f"waiting for {proc.name} to lead ({address})")
    deadline = time.monotonic() + timeout_s
    while not asyncio.run(grpcutil.check_health(address, 2.0)):
        if not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited with code {proc.popen.returncode} before it led; "
                f"log tail:\n{proc.log_tail(10)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{proc.name} did not lead within {timeout_s:.0f}s (another master holding "
                f"the leader key in etcd?); see {proc.log_path}"
            )
        time.sleep(0.2)
    progress(f"{proc.name} leads")
