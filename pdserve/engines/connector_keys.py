"""Which chain a request's chunks live in, for the pdserve vLLM connector's scheduler half
(:mod:`pdserve.engines.connector_scheduler`), or why the request bypasses the store.

A request's chain (:func:`pdserve.hashing.chain_root`) is named by everything besides its
tokens that shapes its KV: the model (the fingerprint), the request's cache salt and the LoRA
adapter it runs through (vLLM's ``request.lora_request``; its identity is the adapter's name and
content digest, :func:`pdserve.model.fingerprint.adapter_identity`, hashed once per adapter and
kept here, so a request hashes no file). Two requests share a chunk only when all of these
agree.

Inputs the chain cannot name yet bypass the store: a request with multimodal inputs
(``mm_features``: its placeholder tokens stand for the image, whose KV the tokens do not
determine) or prompt embeddings (``prompt_embeds``), a request whose adapter's files the
scheduler cannot read, and a request that asks for it (``kv_transfer_params["pdserve"]
["bypass_store"]``: a cold recompute). Such a request is neither looked up, loaded nor saved:
vLLM computes it all, so it is never served KV computed for other inputs. Each reason is logged
once per connector and every bypassed request counted in
``pdserve_kv_store_bypassed_requests_total{reason}``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import hashing
from pdserve.engines.connector_data import PARAMS_KEY, log
from pdserve.engines.metrics import BYPASS_REASONS, KV_STORE_BYPASSED
from pdserve.model.fingerprint import adapter_identity

__all__ = ["BYPASS_REASONS", "KeyScope", "RequestKeys", "cache_salt", "request_params"]

#: What the log says of each of :data:`BYPASS_REASONS`.
_WHY = {
    "requested": "kv_transfer_params asked for it (bypass_store)",
    "multimodal": "multimodal inputs (their KV is not named by the prompt's tokens)",
    "prompt_embeds": "prompt embeddings (their KV is not named by token ids)",
    "adapter_unreadable": "the LoRA adapter's files are not readable by the scheduler",
}


@dataclass(frozen=True)
class KeyScope:
    """The chain of one request: its cache salt and adapter identity ("" = none) and the
    chain's root (hex, :func:`pdserve.hashing.chain_root`); or, with ``bypass`` set (one of
    :data:`BYPASS_REASONS`), no chain: the request bypasses the store."""

    salt: str = ""
    adapter: str = ""
    root: str = ""
    bypass: str = ""
    #: The tenant the chunks are tagged with (``kv_transfer_params["pdserve"]["tenant"]``,
    #: KVNamespace.tenant; "" = none): what the store's tenant shares and pins count.
    tenant: str = ""

    def chunk_keys(self, fp: hashing.ModelFingerprint, tokens: list[int]) -> list[str]:
        return hashing.chunk_keys(fp, tokens, self.salt, self.adapter)

    def tail_key(self, fp: hashing.ModelFingerprint, tokens: list[int], req_id: str) -> str:
        return hashing.tail_key(fp, tokens, req_id, self.salt, self.adapter)


def request_params(request: Any) -> dict[str, Any]:
    """pdserve's entry of the request's ``kv_transfer_params`` ({} when none)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    inner = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    return inner if isinstance(inner, dict) else {}


def cache_salt(request: Any) -> str:
    """The request's cache salt ("" = none): vLLM's ``Request.cache_salt``, which the engine
    sets from the prompt's ``cache_salt`` (and which salts vLLM's own block hashes)."""
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) else ""


class RequestKeys:
    """Each request's :class:`KeyScope` under one fingerprint, with the adapter identities
    seen so far (by vLLM's ``lora_name``, ``lora_int_id`` and ``lora_path``)."""

    def __init__(self, fp: hashing.ModelFingerprint) -> None:
        self.fp = fp
        #: adapter identity of each (name, int id, path); "" = its files were not readable
        self._adapters: dict[tuple[str, int, str], str] = {}
        self._logged: set[str] = set()

    def scope(self, request: Any) -> KeyScope:
        """The chain of ``request`` (a vLLM ``Request``, or anything with its attributes),
        or its bypass reason. A bypass is logged (once per reason) and counted: call this once
        per request."""
        reason = self._bypass_reason(request)
        adapter = ""
        if not reason and getattr(request, "lora_request", None) is not None:
            adapter = self.adapter(request.lora_request)
            reason = "" if adapter else "adapter_unreadable"
        if reason:
            KV_STORE_BYPASSED.labels(reason).inc()
            if reason not in self._logged:
                self._logged.add(reason)
                log.warning(
                    "pdserve KV connector: a request bypasses the store (computed, neither "
                    "loaded nor saved; said once per reason): %s",
                    _WHY[reason],
                )
            return KeyScope(bypass=reason)
        salt = cache_salt(request)
        root = hashing.chain_root(self.fp, salt, adapter).hex()
        tenant = request_params(request).get("tenant", "")
        return KeyScope(salt, adapter, root, tenant=tenant if isinstance(tenant, str) else "")

    @staticmethod
    def _bypass_reason(request: Any) -> str:
        if request_params(request).get("bypass_store"):
            return "requested"
        if getattr(request, "mm_features", None):
            return "multimodal"
        if getattr(request, "prompt_embeds", None) is not None:
            return "prompt_embeds"
        return ""

    def adapter(self, lora: Any) -> str:
        """The identity of vLLM's ``LoRARequest`` ``lora`` ("" when its files cannot be
        read), hashed on its first request. A request that reloads the adapter in place
        (``load_inplace``: new bytes under the same id) hashes it again; the file digests are
        cached by path, size and modification time, so only changed files are read."""
        name, path = str(lora.lora_name), str(lora.lora_path or "")
        key = (name, int(lora.lora_int_id), path)
        if key not in self._adapters or getattr(lora, "load_inplace", False):
            try:
                self._adapters[key] = adapter_identity(name, path)
            except (OSError, ValueError) as exc:
                log.warning("pdserve KV connector: LoRA adapter %r: %s", name, exc)
                self._adapters[key] = ""
        return self._adapters[key]


def answers_at_first_token(request: Any) -> bool:
    """Whether ``request`` (a vLLM ``Request``; None: unknown) ends with its first token
    (``max_tokens`` 1: a prefill as some proxies send it), so its answer comes at the end of
    the step that saves its prompt's chunks."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "max_tokens", None) == 1


def remote_decode(request: Any) -> bool:
    """vLLM's disaggregated-serving protocol: a proxy asks a prefill engine for one token with
    ``kv_transfer_params: {"do_remote_decode": true}`` and hands what the answer's
    ``kv_transfer_params`` say to the decode engine."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def engine_hashes(request: Any, prompt_len: int, block_size: int) -> list[bytes]:
    """vLLM's block hashes of the prompt's full blocks (``request.block_hashes``, computed
    when prefix caching or a connector is on), or [] when it has none or hashes at another
    granularity than ``block_size`` (a hybrid model's hash block size)."""
    hashes = getattr(request, "block_hashes", None)
    if not hashes or len(hashes) != getattr(request, "num_tokens", -1) // block_size:
        return []
    return [bytes(h) for h in hashes[: prompt_len // block_size]]
