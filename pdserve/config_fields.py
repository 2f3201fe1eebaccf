"""The leaf of configuration, below everything that is configured: :class:`ConfigError`,
:func:`help_field` (a dataclass field with its help text), a field's type and the coercion of a
YAML / env / flag value to it, and :func:`read_config` (one file as a mapping).

It imports nothing of pdserve, so every module may take its ``ConfigError`` and ``help_field``
from here; :mod:`pdserve.config` (the loader, above :mod:`pdserve.compat`) re-exports them, and
user code keeps ``from pdserve.config import ...``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def field_types(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` and its type (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def is_list(tp: Any) -> bool:
    """Whether ``tp`` is ``list[...]``."""
    return typing.get_origin(tp) is list


def unwrap_optional(tp: Any) -> Any:
    """``X`` for ``X | None`` (``Optional[X]``); any other type as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def coerce(name: str, tp: Any, value: Any) -> Any:
    """Converts a YAML/env/flag value to the field's type, with an error naming the field."""
    tp = unwrap_optional(tp)
    if value is None:
        return None
    try:
        if is_list(tp):
            (item_tp,) = typing.get_args(tp) or (str,)
            items = value.split(",") if isinstance(value, str) else list(value)
            return [coerce(name, item_tp, v.strip() if isinstance(v, str) else v) for v in items]
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


#: The values of a setting that is on, off, or decided by where it runs; YAML's booleans (and
#: their spellings on a command line) are taken for on and off.
AUTO_ON_OFF = ("auto", "on", "off")
_BOOLS = {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}


def auto_on_off(name: str, value: object, auto: str) -> str:
    """``value`` of setting ``name`` as one of :data:`AUTO_ON_OFF` (ConfigError naming the
    three, with what ``auto`` means, for anything else)."""
    text = str(value).strip().lower()
    text = _BOOLS.get(text, text)
    if text not in AUTO_ON_OFF:
        raise ConfigError(
            f"{name} must be one of {', '.join(AUTO_ON_OFF)} (auto: {auto}), got {value!r}"
        )
    return text


def read_config(path: str | Path) -> dict[str, Any]:
    """A YAML (or JSON: ``.json``) config file as a mapping, with a ConfigError naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text) if text.strip() else {}
        except ValueError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    else:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data


def help_field(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with help text, for :func:`add_arguments`."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **extra}
        )
    return dataclasses.field(default=default, metadata={"help": help, **extra})
