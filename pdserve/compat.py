"""The configuration keys users bring from Mooncake and LMCache, mapped onto pdserve's settings.

Mooncake's store clients read a flat JSON object (the file ``MOONCAKE_CONFIG_PATH`` names);
LMCache reads a flat YAML file (``LMCACHE_CONFIG_FILE``), whose ``extra_config`` mapping
carries the Mooncake keys when its ``remote_url`` is a Mooncake Store. pdserve accepts both,
from those environment variables or as ``--config FILE``, and also at the top level of its own
sectioned config files. Each key means in pdserve what it means in its own tool; a key whose
meaning pdserve cannot honour is a :class:`~pdserve.config.ConfigError` that says why, never a
silent default. :data:`KEYS` is the table (docs/configuration.md and the tests use it);
:func:`translate` applies it to one service's section.

Precedence, lowest first: field defaults, Mooncake's ``MOONCAKE_*`` variables (read only without
``MOONCAKE_CONFIG_PATH``, as Mooncake does), the file ``MOONCAKE_CONFIG_PATH`` names, the file
``LMCACHE_CONFIG_FILE`` names, these keys at the top of ``--config``, the service's own
section of ``--config``, ``PDSERVE_<SECTION>_<FIELD>`` variables, flags.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import compat_upstream as upstream
from pdserve import errors
from pdserve.compat_transport import check_metadata_server, check_transport
from pdserve.config_fields import ConfigError
from pdserve.errors import did_you_mean
from pdserve.sizes import parse_size

#: Environment variables that name a Mooncake / LMCache config file, as those tools read them.
MOONCAKE_ENV = "MOONCAKE_CONFIG_PATH"
LMCACHE_ENV = "LMCACHE_CONFIG_FILE"

#: What pdserve's services pass over in the file ``LMCACHE_CONFIG_FILE`` names: LMCache's own
#: settings, and its CPU buffer (``local_cpu``, ``max_local_cpu_size``: the LMCache engine's,
#: which its remote backends need; in pdserve's own config files they are refused, pdserve
#: having no per-process CPU tier).
LMCACHE_ENGINE = upstream.LMCACHE_OWN | {"local_cpu", "max_local_cpu_size"}
#: ``extra_config`` keys of LMCache's remote storage plugins (``remote_storage_plugin.<name>.
#: <field>``, pdserve's own LMCache plugin among them): the plugin's, which checks them itself.
LMCACHE_PLUGIN_PREFIX = "remote_storage_plugin."

#: Service sections whose workers reach the store through an engine (prefill, decode).
WORKERS = ("prefill", "decode")
#: Every service section that has ``advertise_host`` (all but ``up``).
SERVICES = ("meta", "kvstore_master", "kvstore_node", "prefill", "decode", "router")


@dataclass(frozen=True)
class Key:
    """One familiar key: where users know it from, what it becomes in pdserve, and when pdserve
    refuses it."""

    name: str
    source: str  # "mooncake" | "lmcache"
    meaning: str
    pdserve: str
    refused: str = ""


KEYS: tuple[Key, ...] = (
    Key(
        "local_hostname",
        "mooncake",
        "the address other machines reach this process at",
        "`advertise_host` of every service (`up`: `host`); the Mooncake client's local "
        "hostname with `store_backend: mooncake`",
    ),
    Key(
        "metadata_server",
        "mooncake",
        "the Transfer Engine's metadata server: `P2PHANDSHAKE`, `http://host:port/metadata` "
        "(`pdserve meta --http-metadata` serves this protocol), `etcd://host:port` or "
        "`redis://host:port`",
        "`store_metadata_server` (prefill, decode, router)",
        "anything but `P2PHANDSHAKE` with pdserve's own store, whose Mooncake transport "
        "connects peer to peer",
    ),
    Key(
        "master_server_address",
        "mooncake",
        "`host:port` of `mooncake_master`",
        "`store_backend: mooncake` + `store_master` (prefill, decode, router)",
        "in `pdserve up`, which starts its own store",
    ),
    Key(
        "protocol",
        "mooncake",
        "Transfer Engine transport: `tcp` or `rdma`",
        "`store_protocol` (prefill, decode, router)",
        "`rdma` on a machine without RDMA devices, or with pdserve's own store (tcp only); "
        "any other value",
    ),
    Key(
        "device_name",
        "mooncake",
        "RDMA device(s), comma-separated (e.g. `mlx5_0`); empty for tcp",
        "`store_device` (prefill, decode, router)",
        "a device this machine does not have, or any device with `protocol: tcp`",
    ),
    Key(
        "global_segment_size",
        "mooncake",
        "memory this process contributes to the pool: bytes, or `512MB` / `4GB` "
        "(Mooncake's units are binary: 1 GB = 1024^3 bytes)",
        "the storage nodes' segment: `kvstore_node.segment_sizes`, `up.segment_size`; with "
        "`store_backend: mooncake`, the workers' `store_segment_size`",
    ),
    Key(
        "local_buffer_size",
        "mooncake",
        "the client's registered transfer buffer: bytes or `512MB`",
        "`store_buffer_size` (prefill, decode, router; pdserve's own client sizes its "
        "buffers per request)",
    ),
    Key(
        "transfer_timeout",
        "mooncake",
        "seconds one transfer may take (LMCache's Mooncake `extra_config`)",
        "`store_timeout_s` (prefill, decode)",
    ),
    Key(
        "chunk_size",
        "lmcache",
        "tokens per stored KV chunk",
        "`chunk_size` (prefill, decode, router, up)",
    ),
    Key(
        "remote_url",
        "lmcache",
        "the remote store: `pdserve://MASTER_HOST:PORT` (pdserve's KV store master) or "
        "`mooncakestore://MASTER_HOST:PORT/` (a Mooncake Store)",
        "`store_backend` + `store_master` (prefill, decode, router), "
        "`kvstore_node.master_address` (pdserve://)",
        "other schemes (`lm://`, `redis://`, `infinistore://`, ...): pdserve keeps KV only in "
        "its own store or Mooncake's; in `pdserve up`, which starts its own store",
    ),
    Key(
        "remote_serde",
        "lmcache",
        "how chunks are serialized in the remote store",
        "`naive` is what pdserve does (raw tensor bytes behind a checksummed header)",
        "`cachegen` and other codecs: use `kv_compression: bf16 | fp8` to store fewer bytes",
    ),
    Key(
        "local_cpu",
        "lmcache",
        "keep a hot copy of the KV in this process's CPU memory",
        "`false` is what pdserve does: every worker reads the pooled store (shared memory on "
        "the same host)",
        "`true`: pdserve has no per-process CPU tier; size the pool with "
        "`global_segment_size` / `kvstore_node.segment_sizes` instead",
    ),
    Key(
        "max_local_cpu_size",
        "lmcache",
        "GB of that local CPU tier (LMCache also sizes its staging buffer with it)",
        "accepted with `local_cpu: false` (pdserve stages each request's chunks in buffers "
        "of their own size)",
        "a negative number",
    ),
    Key(
        "extra_config",
        "lmcache",
        "LMCache's backend options; for `mooncakestore://` it holds the Mooncake keys above",
        "each Mooncake key inside it as above",
        "keys other than the Mooncake ones above",
    ),
)

BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
MOONCAKE_KEYS = tuple(k.name for k in KEYS if k.source == "mooncake")
LMCACHE_KEYS = tuple(k.name for k in KEYS if k.source == "lmcache")


def _remote_url(url: str, *, what: str) -> tuple[str, str]:
    """(store backend, master host:port) of an LMCache ``remote_url``."""
    scheme, sep, rest = url.partition("://")
    address = rest.strip("/")
    backends = {"pdserve": "pdserve", "mooncakestore": "mooncake"}
    if not sep or scheme not in backends:
        raise ConfigError(
            f"{what}: remote_url {url!r}: pdserve keeps KV in its own store or a Mooncake "
            "Store, so remote_url must be pdserve://MASTER_HOST:PORT or "
            f"mooncakestore://MASTER_HOST:PORT/ (LMCache's {scheme or url!r} servers are not "
            "a pdserve store)"
        )
    if scheme == "pdserve":  # its ?key=value settings are the LMCache adapter's
        from pdserve.integrations.lmcache_url import settings_from_url

        try:
            return "pdserve", settings_from_url(url).master_address
        except errors.InvalidArgument as exc:
            raise ConfigError(f"{what}: {exc}") from exc
    if not re.fullmatch(r"[^\s/:]+:\d+", address):
        raise ConfigError(f"{what}: remote_url {url!r} must name the master as HOST:PORT")
    return backends[scheme], address


def flatten(data: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """The familiar keys of a file's top level, with LMCache's ``extra_config`` Mooncake keys
    lifted beside them; a ConfigError names any other key in ``extra_config``."""
    out = {k: v for k, v in data.items() if k in BY_NAME and k != "extra_config"}
    extra = data.get("extra_config")
    if extra is None:
        return out
    if not isinstance(extra, Mapping):
        raise ConfigError(f"config file {path}: extra_config must be a mapping")
    for key, value in extra.items():
        if str(key).startswith(LMCACHE_PLUGIN_PREFIX):
            continue  # an LMCache plugin's setting (pdserve's LMCache plugin checks its own)
        bare = str(key).removeprefix("mooncake_")  # LMCache's prefixed form of a Mooncake key
        if bare in upstream.REFUSED:
            upstream.check(bare, value, what=f"config file {path}: extra_config")
            continue
        if bare in MOONCAKE_KEYS:
            key = bare
        else:
            raise ConfigError(
                f"config file {path}: unknown key extra_config.{key}{did_you_mean(key, MOONCAKE_KEYS)}"
                f" (pdserve takes these Mooncake keys there: {', '.join(MOONCAKE_KEYS)})"
            )
        if key in out and out[key] != value:
            raise ConfigError(
                f"config file {path}: {key} is set twice, differently, at the top level and "
                "in extra_config"
            )
        out[key] = value
    return out


def translate(keys: Mapping[str, Any], section: str, what: str) -> dict[str, Any]:
    """The pdserve settings of ``section`` that the familiar ``keys`` (from :func:`flatten`)
    mean; ``what`` names where they came from in errors ("config file PATH"). Settings a
    section does not have are left out: each service takes what applies to it."""
    for name in keys:
        if name not in BY_NAME:
            raise ConfigError(f"{what}: unknown key {name!r}{did_you_mean(name, BY_NAME)}")
    out: dict[str, Any] = {}
    store_sections = (*WORKERS, "router")
    backend = ""
    if keys.get("remote_url"):
        backend, master = _remote_url(str(keys["remote_url"]), what=what)
        if section == "up":
            raise ConfigError(
                f"{what}: remote_url names an existing store, and pdserve up starts its own: "
                "start the services one by one (pdserve prefill / decode / router) to use it"
            )
        if section in store_sections:
            out.update(store_backend=backend, store_master=master)
        if section == "kvstore_node" and backend == "pdserve":
            out["master_address"] = master
    if keys.get("master_server_address"):
        master = str(keys["master_server_address"])
        if section == "up":
            raise ConfigError(
                f"{what}: master_server_address names a Mooncake Store, and pdserve up starts "
                "its own store: start the services one by one with --store-backend mooncake"
            )
        if backend == "pdserve":
            raise ConfigError(
                f"{what}: remote_url names pdserve's store but master_server_address a "
                "Mooncake master: keep one"
            )
        backend = "mooncake"
        if section in store_sections:
            if out.get("store_master", master) != master:
                raise ConfigError(
                    f"{what}: remote_url and master_server_address name different masters"
                )
            out.update(store_backend="mooncake", store_master=master)
    serde = keys.get("remote_serde")
    if serde not in (None, "naive"):
        raise ConfigError(
            f"{what}: remote_serde {serde!r}: pdserve stores KV chunks as raw tensor bytes "
            "(what LMCache calls 'naive'); to store fewer bytes set kv_compression: bf16 or "
            "fp8 in the prefill and decode sections"
        )
    local_cpu = keys.get("local_cpu")
    if local_cpu not in (None, False):
        raise ConfigError(
            f"{what}: local_cpu {local_cpu!r}: pdserve has no per-process CPU cache tier; "
            "every worker reads the pooled KV store (over shared memory on the same host). Set "
            "local_cpu: false and size the pool with global_segment_size (or "
            "kvstore_node.segment_sizes)"
        )
    if "max_local_cpu_size" in keys:
        size = keys["max_local_cpu_size"]
        if isinstance(size, bool) or not isinstance(size, int | float) or size < 0:
            raise ConfigError(f"{what}: max_local_cpu_size must be a number of GB >= 0")
    if keys.get("chunk_size") is not None and section in (*store_sections, "up"):
        out["chunk_size"] = keys["chunk_size"]
    if keys.get("local_hostname"):
        host = str(keys["local_hostname"])
        if section == "up":
            out["host"] = host
        elif section in SERVICES:
            out["advertise_host"] = host
    protocol = str(keys.get("protocol") or "tcp")
    device = str(keys.get("device_name") or "")
    if "protocol" in keys or "device_name" in keys:
        check_transport(protocol, device, what=what)
        if section in store_sections:
            out.update(store_protocol=protocol, store_device=device)
    if keys.get("metadata_server"):
        server = str(keys["metadata_server"])
        check_metadata_server(server, what=what)
        if section in store_sections:
            out["store_metadata_server"] = server
    if keys.get("global_segment_size") is not None:
        size = parse_size(
            keys["global_segment_size"], what=f"{what}: global_segment_size", minimum=0
        )
        if section == "kvstore_node" and size:
            out["segment_sizes"] = [str(size)]
        elif section == "up" and size:
            out["segment_size"] = str(size)
        elif section in WORKERS and backend == "mooncake":
            out["store_segment_size"] = str(size)
    if keys.get("local_buffer_size") is not None:
        size = parse_size(keys["local_buffer_size"], what=f"{what}: local_buffer_size", minimum=0)
        if section in store_sections:
            out["store_buffer_size"] = str(size)
    if keys.get("transfer_timeout") is not None and section in WORKERS:
        out["store_timeout_s"] = keys["transfer_timeout"]
    return out


def read_file(path: str | Path) -> dict[str, Any]:
    """A Mooncake JSON or LMCache YAML file as a mapping (ConfigError naming the file)."""
    from pdserve.config_fields import read_config

    return read_config(path)


#: Mooncake's configuration by environment alone (``MooncakeConfig.load_from_env``: read when
#: ``MOONCAKE_CONFIG_PATH`` is unset and ``MOONCAKE_MASTER`` is set): variable -> its key.
MOONCAKE_ENV_KEYS = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
}


def from_mooncake_env(env: Mapping[str, str], section: str) -> dict[str, Any]:
    """``section``'s settings from Mooncake's environment-only configuration, as Mooncake reads
    it (only when ``MOONCAKE_CONFIG_PATH`` is unset and ``MOONCAKE_MASTER`` is set)."""
    if env.get(MOONCAKE_ENV) or not env.get("MOONCAKE_MASTER"):
        return {}
    for var, key in upstream.REFUSED_ENV.items():
        upstream.check(key, env.get(var), what=f"{var} (Mooncake's environment)")
    keys = {key: env[var] for var, key in MOONCAKE_ENV_KEYS.items() if env.get(var)}
    return translate(keys, section, "Mooncake's environment (MOONCAKE_*)")


def from_env(env: Mapping[str, str], section: str) -> dict[str, Any]:
    """``section``'s settings from Mooncake's environment-only configuration, then the files
    ``MOONCAKE_CONFIG_PATH`` and ``LMCACHE_CONFIG_FILE`` name (LMCache's over Mooncake's). Every
    key of those files must be a familiar one: a ConfigError names the file, the variable and
    the key otherwise."""
    out: dict[str, Any] = from_mooncake_env(env, section)
    for var in (MOONCAKE_ENV, LMCACHE_ENV):
        path = env.get(var)
        if not path:
            continue
        try:
            data = read_file(path)
            if var == LMCACHE_ENV:  # LMCache's own settings are LMCache's to read
                data = {k: v for k, v in data.items() if k not in LMCACHE_ENGINE}
            for key in [k for k in data if k not in BY_NAME and upstream.known(k)]:
                upstream.check(key, data.pop(key), what=f"config file {path}")
            unknown = [k for k in data if k not in BY_NAME]
            if unknown:
                allowed = MOONCAKE_KEYS if var == MOONCAKE_ENV else BY_NAME
                raise ConfigError(
                    f"config file {path}: unknown key(s) "
                    + ", ".join(f"{k!r}{did_you_mean(k, allowed)}" for k in unknown)
                )
            out.update(translate(flatten(data, path), section, f"config file {path}"))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (the file {var} names)") from exc
    return out


def env_files(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Mooncake / LMCache files named in ``env`` (default: this process's environment)."""
    env = os.environ if env is None else env
    return {v: env[v] for v in (MOONCAKE_ENV, LMCACHE_ENV) if env.get(v)}


def markdown_table() -> str:
    """The key table of docs/configuration.md (a test keeps the doc in step)."""
    rows = ["| key | from | meaning there | in pdserve | refused |", "|---|---|---|---|---|"]
    for k in KEYS:
        rows.append(f"| `{k.name}` | {k.source} | {k.meaning} | {k.pdserve} | {k.refused or '-'} |")
    return "\n".join(rows)
