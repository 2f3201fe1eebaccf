"""Prefix reuse of a trace run's measured window: the ideal (a cache that keeps everything,
:func:`pdserve.bench.serve.workloads.ideal_prefix_reuse`) given the history replayed before
it and without, beside what each system achieved: the prompt tokens its answers' usage says
came from cache (``prompt_tokens_details.cached_tokens``, as vLLM and pdserve's router report
it), and for pdserve the split its router's ``pdserve_router_prompt_tokens_total`` gives:
from the store (the pool) and from the workers' own prefix caches. "Of ideal" is against the
ideal the run had: without history when ``--skip-history`` left it out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.bench.serve.history import HistoryPlan
    from pdserve.bench.serve.report import SystemResult
    from pdserve.bench.serve.workloads import PrefixReuse

#: The router's prompt-token sources: from the pool, from a worker's own prefix cache.
STORE_SOURCE = "store"
LOCAL_SOURCE = "prefix_cache"


def achieved(res: SystemResult, ideal: PrefixReuse) -> dict[str, Any]:
    """One system's reuse in the window: cached prompt tokens (usage) as a share of the
    completed requests' prompt tokens and of the ideal share (at the trace's blocks, and at
    the engines' cache blocks); the store / local split when
    its router reports one (shares of the same prompt tokens); its history's outcome."""
    m = res.metrics
    prompt = m.total_input_tokens
    out: dict[str, Any] = {"prompt_tokens": prompt, "cached_tokens": m.cached_tokens}
    share = m.cached_tokens / prompt if m.cached_tokens is not None and prompt else None
    out["cached_share"] = share
    for key, ideal_share in (
        ("of_ideal", ideal.token_fraction),
        ("of_cache_ideal", ideal.cache_fraction),
    ):
        out[key] = share / ideal_share if share is not None and ideal_share else None
    router = res.router.prompt_tokens if res.router is not None else {}
    for key, source in (("store", STORE_SOURCE), ("local", LOCAL_SOURCE)):
        n = router.get(source)
        out[f"{key}_tokens"] = None if n is None else int(n)
        out[f"{key}_share"] = None if n is None or not prompt else n / prompt
    history = getattr(res, "history", None)
    out["history"] = history.to_json() if history is not None else None
    return out


def reuse_json(plan: HistoryPlan, results: Sequence[SystemResult]) -> dict[str, Any]:
    """The ``reuse`` section of the run's JSON."""
    return {
        "history_rows": plan.rows,
        "history_replayed": bool(plan.rows) and not plan.skipped,
        "window_rows": plan.window_rows,
        "block_tokens": plan.block,
        "ideal_given_history": {
            **asdict(plan.given),
            "fraction": plan.given.fraction,
            "token_fraction": plan.given.token_fraction,
            "cache_fraction": plan.given.cache_fraction,
        },
        "ideal_without_history": {
            **asdict(plan.alone),
            "fraction": plan.alone.fraction,
            "token_fraction": plan.alone.token_fraction,
            "cache_fraction": plan.alone.cache_fraction,
        },
        "systems": {r.name: achieved(r, plan.ideal) for r in results},
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_reuse(plan: HistoryPlan, results: Sequence[SystemResult]) -> str:
    """The reuse table printed after the systems' results."""
    given, alone = plan.given, plan.alone
    head = f" Prefix reuse of the measured window ({plan.window_rows} rows) "
    out = [f"{head:=^92}"]
    if plan.skipped:
        out.append(
            f"ideal, history of {plan.rows} rows skipped (caches cold): "
            f"{alone.token_fraction:.1%} of prompt tokens ({alone.fraction:.1%} of trace "
            f"blocks); given that history it would be {given.token_fraction:.1%}"
        )
    elif plan.rows:
        out.append(
            f"ideal, given {plan.rows} rows of history: {given.token_fraction:.1%} of prompt "
            f"tokens ({given.fraction:.1%} of trace blocks); without history: "
            f"{alone.token_fraction:.1%} ({alone.fraction:.1%})"
        )
    else:
        out.append(
            f"ideal (no history): {given.token_fraction:.1%} of prompt tokens "
            f"({given.fraction:.1%} of trace blocks)"
        )
    ideal = plan.ideal
    out.append(
        f"at the engines' {ideal.cache_block}-token cache blocks (what a block cache can serve):"
        f" {ideal.cache_fraction:.1%}"
    )
    at = f"of @{ideal.cache_block}"
    cols = ("system", "history served/failed", "from cache", "of ideal", at, "store", "local")
    out.append(
        f"{cols[0]:<18}{cols[1]:>22}{cols[2]:>12}{cols[3]:>10}{cols[4]:>10}{cols[5]:>10}"
        f"{cols[6]:>10}"
    )
    for res in results:
        a = achieved(res, ideal)
        h = a["history"]
        hist = "-" if h is None else f"{h['served']}/{h['failed']}"
        out.append(
            f"{res.name:<18}{hist:>22}{_pct(a['cached_share']):>12}{_pct(a['of_ideal']):>10}"
            f"{_pct(a['of_cache_ideal']):>10}{_pct(a['store_share']):>10}"
            f"{_pct(a['local_share']):>10}"
        )
    out.append(
        "from cache: the answers' usage.prompt_tokens_details.cached_tokens over their prompt "
        "tokens; store / local: pdserve's router counts (of the same prompt tokens), from the "
        "pool and from the workers' own caches"
    )
    out.append("=" * 92)
    return "\n".join(out)
