"""The models one router serves, each by its served name, the first the default.

A router config names them in ``models`` (``SERVED=MODEL`` or ``MODEL`` entries: the served
name requests use, and the model folder or a name :func:`pdserve.model.prepare.resolve_model`
knows); without ``models`` it serves ``model`` as ``served_name``, as it always did.
``model_settings`` may give each served name its own values of the router fields that belong to
a model (:data:`MODEL_FIELDS`: limits, KV settings, parsers, static workers).

Each model gets a :class:`~pdserve.services.router.frontend.Frontend` of its own (tokenizer,
limits, KV fingerprint, worker pool, orchestrator: ``services/router/server.py``, ``build``);
they share admission, the API keys, the store's prefix lookup and the /v1/responses store. A
worker registers the served name it serves (meta's ``Instance.model``) and only that model's
pool takes it: a worker of another model is simply not that pool's, never refused or logged.
:class:`Models` picks the frontend of a request's ``model`` (HTTP body, gRPC request): empty
means the default, an unknown name is NOT_FOUND (HTTP 404 ``model_not_found``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pdserve.config_fields import ConfigError, coerce
from pdserve.errors import ModelNotFound

if TYPE_CHECKING:
    from pdserve.services.router.request import Limits

#: The router fields ``model_settings`` may set per served model.
MODEL_FIELDS = (
    "max_model_len",
    "max_tokens_limit",
    "default_max_tokens",
    "kv_dtype",
    "chunk_size",
    "kv_compression",
    "tool_call_parser",
    "reasoning_parser",
    "prefill",
    "decode",
)


@dataclass(frozen=True)
class ModelSpec:
    """One served model: ``name`` in requests (and on its workers), ``model`` its folder or a
    name :func:`~pdserve.model.prepare.resolve_model` knows."""

    name: str
    model: str

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """``SERVED=MODEL`` (served as SERVED) or ``MODEL`` (served under its own name);
        ConfigError for an empty part."""
        name, sep, model = spec.strip().partition("=")
        if not sep:
            name = model = name
        name, model = name.strip(), model.strip()
        if not name or not model:
            raise ConfigError(f"model {spec!r}: expected SERVED=MODEL or MODEL, both non-empty")
        return cls(name, model)


def model_specs(models: Sequence[str]) -> list[ModelSpec]:
    """``models`` parsed, ConfigError when a served name repeats."""
    specs = [ModelSpec.parse(s) for s in models]
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"models: served name(s) {', '.join(twice)} given twice")
    return specs


class ModelsConfig(Protocol):
    """The router config's fields this module reads and sets
    (:class:`~pdserve.services.router.config.RouterConfig` has them; it calls
    :func:`check_models` when it validates, so this module names no config class)."""

    meta: str
    model: str
    served_name: str
    models: list[str]
    model_settings: dict[str, Any]
    prefill: list[str]
    decode: list[str]


C = TypeVar("C", bound=ModelsConfig)


class Served(Protocol):
    """What :class:`Models` needs of a model's frontend
    (:class:`~pdserve.services.router.frontend.Frontend`): its limits, which name the model."""

    limits: Limits


F = TypeVar("F", bound=Served)


def check_models(cfg: ModelsConfig) -> None:
    """Validates ``models`` and ``model_settings`` and, when ``models`` is given, sets
    ``model``/``served_name`` to the first (the default: what the router registers as)."""
    if not cfg.models:
        if cfg.model_settings:
            raise ConfigError("model_settings needs models (the served names it configures)")
        return
    specs = model_specs(cfg.models)
    cfg.model, cfg.served_name = specs[0].model, specs[0].name
    names = {s.name for s in specs}
    types = typing.get_type_hints(type(cfg))
    normalized: dict[str, dict[str, Any]] = {}
    for name, settings in cfg.model_settings.items():
        if name not in names:
            raise ConfigError(f"model_settings names {name!r}, which is not in models {names}")
        if not isinstance(settings, Mapping):
            raise ConfigError(f"model_settings[{name!r}] must be a mapping of router fields")
        bad = sorted(set(settings) - set(MODEL_FIELDS))
        if bad:
            raise ConfigError(
                f"model_settings[{name!r}]: {', '.join(bad)} cannot differ per model; "
                f"these can: {', '.join(MODEL_FIELDS)}"
            )
        normalized[name] = {
            k: coerce(f"model_settings.{name}.{k}", types[k], v) for k, v in settings.items()
        }
    cfg.model_settings = normalized
    if len(specs) > 1 and (cfg.prefill or cfg.decode):
        raise ConfigError(
            "with several models, static workers belong to one: give them as "
            "model_settings: {NAME: {decode: [...], prefill: [...]}}, not as prefill/decode"
        )
    if not cfg.meta:
        empty = [n for n in names if not cfg.model_settings.get(n, {}).get("decode")]
        if empty:
            raise ConfigError(
                f"model(s) {', '.join(sorted(empty))} have no workers: give --meta (workers "
                "register the model they serve) or their decode addresses in model_settings"
            )


def model_configs(cfg: C) -> list[C]:
    """One router config per served model of the validated ``cfg``, the default first: ``cfg``
    with the model's folder, served name and ``model_settings`` (``cfg`` itself without
    ``models``)."""
    if not cfg.models:
        return [cfg]
    out = []
    for spec in model_specs(cfg.models):
        settings = cfg.model_settings.get(spec.name, {})
        out.append(
            dataclasses.replace(
                cfg,
                model=spec.model,
                served_name=spec.name,
                models=[],
                model_settings={},
                **{"prefill": [], "decode": [], **settings},
            )
        )
    return out


class Models(Generic[F]):
    """The frontends of the served models by served name; the first is the default."""

    def __init__(self, frontends: Sequence[F]) -> None:
        if not frontends:
            raise ValueError("a router serves at least one model")
        self._all = list(frontends)
        self._by_name = {fe.limits.model: fe for fe in self._all}
        if len(self._by_name) != len(self._all):
            raise ValueError(f"served names repeat: {[fe.limits.model for fe in self._all]}")

    @property
    def default(self) -> F:
        return self._all[0]

    def all(self) -> list[F]:
        """Every model's frontend, the default first."""
        return list(self._all)

    def names(self) -> list[str]:
        return [fe.limits.model for fe in self._all]

    def find(self, name: str) -> F | None:
        return self._by_name.get(name)

    def select(self, model: object) -> F:
        """The frontend of a request's ``model``: the default when it is empty or not a string
        (the request's own validation then names the field), NOT_FOUND
        (:class:`~pdserve.errors.ModelNotFound`, param ``model``) when no model has that name."""
        if not isinstance(model, str) or not model:
            return self.default
        fe = self._by_name.get(model)
        if fe is None:
            served = ", ".join(repr(n) for n in self.names())
            raise ModelNotFound(
                f"model: unknown model {model!r:.100}; this deployment serves {served}",
                param="model",
            )
        return fe
