"""One way to configure every service: a dataclass per service, filled from (lowest to highest
precedence) field defaults, a YAML file, environment variables and command-line flags.

A YAML file holds one mapping per service section, so a whole cluster shares one file::

    kvstore_master:
      port: 50051
    prefill:
      chunk_size: 256

Environment variables are ``PDSERVE_<SECTION>_<FIELD>`` (upper case), e.g.
``PDSERVE_PREFILL_CHUNK_SIZE=512``. Flags are ``--field-name``. Every field carries its help
text in ``metadata["help"]``; ``--help`` prints it with the default.

Files are strict: a top-level key must be a service section (:data:`SECTIONS`) or a key users
bring from Mooncake or LMCache (:mod:`pdserve.compat`, which also reads the files
``MOONCAKE_CONFIG_PATH`` and ``LMCACHE_CONFIG_FILE`` name), and every field of every section
must exist: anything else is a :class:`ConfigError` naming the key and the file, with the
closest known name.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pdserve import compat, compat_upstream
from pdserve.config_fields import (
    ConfigError,
    coerce,
    field_types,
    help_field,
    read_config,
    unwrap_optional,
)
from pdserve.errors import did_you_mean

#: The loader's names, and the leaf's that users import from here (re-exported).
__all__ = [
    "SECTIONS",
    "ConfigError",
    "add_arguments",
    "check_file",
    "from_args",
    "help_field",
    "load",
    "read_config",
    "section_class",
]

T = TypeVar("T")


#: Every section a config file may hold, and the config class that reads it (imported only to
#: check a file): one file can describe a whole cluster (``pdserve up --config``).
SECTIONS: dict[str, str] = {
    "up": "pdserve.commands.up:UpConfig",
    "meta": "pdserve.services.meta.server:MetaConfig",
    "kvstore_master": "pdserve.services.kvstore.master.config:MasterConfig",
    "kvstore_node": "pdserve.services.kvstore.node.config:NodeConfig",
    "prefill": "pdserve.services.prefill.config:PrefillConfig",
    "decode": "pdserve.services.decode.config:DecodeConfig",
    "router": "pdserve.services.router.config:RouterConfig",
}


def section_class(section: str) -> type:
    module, _, name = SECTIONS[section].partition(":")
    return getattr(importlib.import_module(module), name)


def check_file(path: str | Path, data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Reads (unless given) and checks a whole config file: every top-level key is a section or
    a familiar Mooncake / LMCache key (:mod:`pdserve.compat`), every section a mapping of
    fields its service has, every value of its field's type. Returns the data."""
    data = read_config(path) if data is None else dict(data)
    known = [*SECTIONS, *compat.BY_NAME]
    for key, value in data.items():
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: config section {key!r} must be a mapping")
            types_ = field_types(section_class(key))
            unknown = sorted(set(value) - set(types_))
            if unknown:
                hints = "".join(did_you_mean(u, types_) for u in unknown)
                raise ConfigError(
                    f"config file {path}: config section {key!r}: unknown field(s) "
                    f"{', '.join(unknown)}{hints}; known: {', '.join(sorted(types_))}"
                )
            for name, v in value.items():
                coerce(f"{key}.{name}", types_[name], v)
        elif compat_upstream.known(key):
            compat_upstream.check(key, value, what=f"config file {path}")
        elif key not in compat.BY_NAME:
            raise ConfigError(
                f"config file {path}: unknown section or key {key!r}{did_you_mean(key, known)}; "
                f"sections: {', '.join(SECTIONS)}; Mooncake / LMCache keys: "
                f"{', '.join(compat.BY_NAME)}"
            )
    return data


def load(
    cls: type[T],
    section: str,
    *,
    yaml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Builds ``cls`` from defaults, then the YAML section, then env, then ``overrides``."""
    env = os.environ if env is None else env
    types_ = field_types(cls)
    values: dict[str, Any] = {}

    def take(settings: Mapping[str, Any]) -> None:
        values.update({k: coerce(k, types_[k], v) for k, v in settings.items() if k in types_})

    # the files MOONCAKE_CONFIG_PATH / LMCACHE_CONFIG_FILE name, as those tools read them
    take(compat.from_env(env, section))
    if yaml_path is not None:
        data = read_config(yaml_path)
        if section in SECTIONS:
            check_file(yaml_path, data)  # the whole file: a typo anywhere is an error
        keys = compat.flatten(data, yaml_path)
        take(compat.translate(keys, section, f"config file {yaml_path}"))
        sect = data.get(section) or {}
        if not isinstance(sect, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        unknown = sorted(set(sect) - set(types_))
        if unknown:
            hints = "".join(did_you_mean(u, types_) for u in unknown)
            raise ConfigError(
                f"config file {yaml_path}: config section {section!r}: unknown field(s) "
                f"{', '.join(unknown)}{hints}; known: {', '.join(sorted(types_))}"
            )
        values.update({k: coerce(k, types_[k], v) for k, v in sect.items()})
    prefix = f"PDSERVE_{section.upper()}_"
    for name, tp in types_.items():
        key = prefix + name.upper()
        if key in env:
            values[name] = coerce(name, tp, env[key])
    for name, value in (overrides or {}).items():
        if name not in types_:
            raise ConfigError(
                f"unknown config field {name!r} for {section}{did_you_mean(name, types_)}"
            )
        if value is not None:
            values[name] = coerce(name, types_[name], value)
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds ``--config`` and one ``--field-name`` flag per dataclass field (default: unset)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML (or JSON) file with a section per service, and/or the Mooncake / LMCache "
        "keys users know (a Mooncake JSON or LMCACHE_CONFIG_FILE YAML works as is: "
        "docs/configuration.md); unknown keys are an error. Flags and PDSERVE_* env vars "
        "override it",
    )
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = unwrap_optional(types_[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{f.metadata.get('help', '')} (default: {default})".strip()
        if tp is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            metavar = f.metadata.get("metavar") or f.name.split("_")[-1].upper()
            parser.add_argument(flag, dest=f.name, default=None, metavar=metavar, help=help_text)


def from_args(cls: type[T], section: str, args: argparse.Namespace) -> T:
    """Builds ``cls`` for ``section`` from parsed flags (see :func:`add_arguments`)."""
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return load(cls, section, yaml_path=getattr(args, "config", None), overrides=overrides)
