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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Converts a YAML/env/flag value to the field's type, with an error naming the field."""
    tp = _unwrap_optional(tp)
    if value is None:
        return None
    try:
        if _is_list(tp):
            (item_tp,) = typing.get_args(tp) or (str,)
            items = value.split(",") if isinstance(value, str) else list(value)
            return [_coerce(name, item_tp, v.strip() if isinstance(v, str) else v) for v in items]
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected a boolean, got {value!r}")
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if tp is Path:
            return Path(value)
        if tp is dict or typing.get_origin(tp) is dict:
            # a YAML mapping, or JSON from a flag or an environment variable
            mapping = json.loads(value) if isinstance(value, str) else value
            if not isinstance(mapping, Mapping):
                raise ValueError(f"expected a mapping (JSON object), got {value!r}")
            return dict(mapping)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config field {name!r}: {exc}") from exc
    raise ConfigError(f"config field {name!r}: unsupported type {tp!r}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
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
    types_ = _field_types(cls)
    values: dict[str, Any] = {}
    if yaml_path is not None:
        sect = read_yaml(yaml_path).get(section) or {}
        if not isinstance(sect, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        unknown = sorted(set(sect) - set(types_))
        if unknown:
            raise ConfigError(
                f"config section {section!r}: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(types_))}"
            )
        values.update({k: _coerce(k, types_[k], v) for k, v in sect.items()})
    prefix = f"PDSERVE_{section.upper()}_"
    for name, tp in types_.items():
        key = prefix + name.upper()
        if key in env:
            values[name] = _coerce(name, tp, env[key])
    for name, value in (overrides or {}).items():
        if name not in types_:
            raise ConfigError(f"unknown config field {name!r} for {section}")
        if value is not None:
            values[name] = _coerce(name, types_[name], value)
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds ``--config`` and one ``--field-name`` flag per dataclass field (default: unset)."""
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="YAML file with a section per service; flags and PDSERVE_* env vars override it",
    )
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = _unwrap_optional(types_[f.name])
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


def help_field(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with help text, for :func:`add_arguments`."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **extra}
        )
    return dataclasses.field(default=default, metadata={"help": help, **extra})
