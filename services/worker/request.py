"""The checks every worker request gets, whichever the role: request id, model, cache salt and
tenant by :mod:`pdserve.validation` (the router's rules too), sampling decoded by
:mod:`pdserve.requests_codec` with the worker's default ``max_tokens``. The tenant is set as
the task's :data:`pdserve.tenants.current`: the engine tags the chunks it saves with it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve import telemetry, tenants
from pdserve.engines.base import Engine
from pdserve.requests import Sampling
from pdserve.requests_codec import sampling_from_proto
from pdserve.services.worker.config import WorkerConfig
from pdserve.v1 import engine_pb2
from pdserve.validation import check_cache_salt, check_model, check_request_id, check_tenant


@dataclass(frozen=True)
class WorkerRequest:
    """The checked fields a PrefillRequest and a DecodeRequest share."""

    request_id: str
    prompt_token_ids: list[int]
    #: Not validated yet: the engine validates it (INVALID_ARGUMENT naming the field).
    sampling: Sampling
    #: "" = none.
    cache_salt: str
    #: No store loads or saves for this request (engine.proto; the router's cold recompute).
    bypass_store: bool = False
    #: Scheduling priority, lower first (vLLM's; any int32).
    priority: int = 0


def check_request(
    request: engine_pb2.PrefillRequest | engine_pb2.DecodeRequest,
    engine: Engine,
    cfg: WorkerConfig,
) -> WorkerRequest:
    """INVALID_ARGUMENT (or NOT_FOUND for another model) naming the field; sets the request
    id of this task's log lines."""
    rid = check_request_id(request.request_id)
    telemetry.request_id_var.set(rid)
    tenants.current.set(check_tenant(request.tenant))
    check_model(request.model, cfg.served_name())
    salt = check_cache_salt(request.cache_salt or None)
    tokens = list(request.prompt_token_ids)
    default = cfg.default_max_tokens(engine.max_model_len, len(tokens))
    sampling = sampling_from_proto(request.sampling, default_max_tokens=default)
    return WorkerRequest(
        rid, tokens, sampling, salt, bool(request.bypass_store), int(request.priority)
    )
