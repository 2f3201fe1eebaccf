"""How the router serves one request (the plan), and the pure rule that picks it."""

from __future__ import annotations

from enum import StrEnum


class Plan(StrEnum):
    """The values are what logs (the trace's ``plan``) and metrics (label ``plan``) show."""

    #: Prefill on a prefill worker, then Decode with its KV handle.
    READ = "read"
    #: Prefill publishing chunk by chunk while Decode loads them as they land.
    WRITE = "write"
    #: Decode without a handle: the decode worker prefills itself.
    LOCAL = "local"
    #: Fallbacks (trace only): every prefill attempt failed, the decode worker prefilled.
    READ_THEN_LOCAL = "read->local"
    WRITE_THEN_LOCAL = "write->local"
    #: Fallback (trace only): the decode worker refused the write-mode handle, so it decoded
    #: with prefill's answer as in the read plan.
    WRITE_THEN_READ = "write->read"


def choose_plan(
    *,
    mode: str,
    prompt_tokens: int,
    cached_tokens: int,
    chunk_size: int,
    prefill_workers: int,
    local_threshold: int,
) -> Plan:
    """The plan for a request in ``mode`` (``read``, ``write`` or ``colocated``).

    ``cached_tokens`` is what the store holds of the prompt, ``chunk_size`` the KV chunk size
    (0 while unknown), ``prefill_workers`` how many prefill workers are in rotation and
    ``local_threshold`` the uncached length below which the decode worker prefills (0 = never).
    Write needs a full chunk before the prompt's last token; without prefill workers, in
    colocated mode, and for short uncached prompts the decode worker prefills (local)."""
    if not prefill_workers or mode not in ("read", "write"):
        return Plan.LOCAL
    if mode == "write" and chunk_size and (prompt_tokens - 1) // chunk_size > 0:
        return Plan.WRITE
    uncached = max(1, prompt_tokens - cached_tokens)
    if local_threshold and uncached < local_threshold:
        return Plan.LOCAL
    return Plan.READ
