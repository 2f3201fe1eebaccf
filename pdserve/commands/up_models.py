"""Several models in one ``pdserve up`` (:mod:`pdserve.commands.up`): ``--model A --model B``
(repeatable; ``SERVED=MODEL`` names a model's served name) or ``models: [A, B]`` in the config
file's ``up`` section.

Each model gets workers of its own, registered under its served name, and the one router
serves them all (``services/router/models.py``: ``--models``), the first the default. The store
keeps their chunks apart by itself: keys derive from each model's fingerprint, whose model id
is the served name (``pdserve kvstore namespaces`` lists one namespace per model).

``prefill_workers`` and ``decode_workers`` count per model. The auto shape gives each model
``min(cores, 8) // models`` colocated workers (prefill and decode in one), at least one: on 2
cores with two models, one worker per model, each pinned to its own core; worker ``n`` of a
role serves model ``n // per-model count`` (``decode-0`` the first model's, ``decode-1`` the
second's with one each). A single model without a served name is today's ``up``, unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.commands.up_settings import UpSettings
from pdserve.config import ConfigError

if TYPE_CHECKING:
    from pdserve.services.router.models import ModelSpec


def specs(cfg: UpSettings) -> list[ModelSpec]:
    """The models ``up`` serves, the default first (``model`` alone without ``models``)."""
    from pdserve.services.router.models import ModelSpec, model_specs

    return model_specs(cfg.models) if cfg.models else [ModelSpec(cfg.model, cfg.model)]


def validate(cfg: UpSettings) -> None:
    """Checks ``models`` (served names once each; not with external engines, which serve
    their own model) and makes ``model`` the first one's."""
    if not cfg.models:
        return
    if cfg.external_engine:
        raise ConfigError(
            "models: external engines serve the model they were started with; give several "
            "models to pdserve's own workers (no external_engine)"
        )
    cfg.model = specs(cfg)[0].model


def worker_flags(cfg: UpSettings, role: str, index: int) -> dict[str, object]:
    """The ``model`` (and ``served_model_name``, when it differs) of worker ``index`` of
    ``role`` (after :meth:`UpSettings.resolve`)."""
    per_model = cfg.prefill_workers if role == "prefill" else cfg.decode_workers
    spec = specs(cfg)[index // max(per_model, 1)]
    name = spec.name if spec.name != spec.model else None
    return {"model": spec.model, "served_model_name": name}


def router_flags(cfg: UpSettings) -> dict[str, object]:
    """The router's model flags: ``model`` alone for one unnamed model, else ``models``."""
    if not cfg.models:
        return {"model": cfg.model}
    return {"models": ",".join(f"{s.name}={s.model}" for s in specs(cfg))}


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--model``, repeatable (the parser must resolve conflicts: it replaces the config's
    single-valued flag); :func:`fold_flag` turns what it collected into config values."""
    parser.add_argument(
        "--model",
        dest="model",
        action="append",
        default=None,
        metavar="[SERVED=]MODEL",
        help="model: 'smollm2' (= HuggingFaceTB/SmolLM2-135M-Instruct, shipped), 'tiny', a model "
        "directory, or a Hugging Face id; SERVED=MODEL serves it as SERVED. Repeat it for "
        "several models behind the one router, the first the default (= models). Default: "
        "smollm2",
    )


def fold_flag(args: argparse.Namespace) -> None:
    """``--model`` given once without a served name is ``model``; otherwise (repeated, or
    ``SERVED=MODEL``) the list is ``models``."""
    given = getattr(args, "model", None)
    if not isinstance(given, list):
        return
    if len(given) == 1 and "=" not in given[0]:
        args.model = given[0]
        return
    if getattr(args, "models", None):
        raise ConfigError("give the models either as --model (repeated) or as --models")
    args.model, args.models = None, given


def resolve_all(cfg: UpSettings) -> list[Path]:
    """Resolves every model (a name, a folder, a Hugging Face id) before anything starts: their
    local folders."""
    from pdserve.model.prepare import resolve_model

    return [resolve_model(spec.model) for spec in specs(cfg)]


def banner_line(cfg: UpSettings) -> str:
    """The banner's line naming the models when there are several ('' for one)."""
    if len(cfg.models) < 2:
        return ""
    names = [s.name for s in specs(cfg)]
    return f"  models  {names[0]} (default), {', '.join(names[1:])}\n"
