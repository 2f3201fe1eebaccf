"""Long-lived sessions in generated traces (``gen-trace --session-rows``, ``--reuse
sessions``), the reuse report beside the ideal, and GPU-shaped memory
(``--engine-kv-cache-gib`` / ``--engine-kv-blocks``) for both systems."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.serve import workloads as wl
from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.gentrace import REUSE_PRESETS, TraceGenConfig, generate_trace
from pdserve.bench.serve.history import HistoryOutcome, HistoryPlan
from pdserve.bench.serve.memory import describe_shape, memory_shape, pdserve_env, resolve_memory
from pdserve.bench.serve.metrics import RequestRecord, RouterFigures, compute_metrics
from pdserve.bench.serve.report import SystemResult
from pdserve.bench.serve.reuse import format_reuse, reuse_json


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _session_starts(rows: list[wl.TraceRow]) -> list[tuple[int, int]]:
    """(row, the row its session began in) for every row; a session is named by the first
    block after the shared block 0."""
    first: dict[int, int] = {}
    out = []
    for i, row in enumerate(rows):
        first.setdefault(row.hash_ids[1], i)
        out.append((i, first[row.hash_ids[1]]))
    return out


def test_sessions_live_session_rows_rows() -> None:
    cfg = TraceGenConfig(rows=600, seed=3, follow_up=0.6, max_turns=40, session_rows=50)
    rows = generate_trace(cfg)
    ages = [i - start for i, start in _session_starts(rows)]
    assert max(ages) < 50  # no turn continues a session older than its lifetime
    assert sum(age > 25 for age in ages) > 20  # turns do spread over it
    # without a lifetime the same parameters continue sessions from far back
    forever = generate_trace(TraceGenConfig(rows=600, seed=3, follow_up=0.6, max_turns=40))
    assert max(i - start for i, start in _session_starts(forever)) > 200
    # later turns extend the session's earlier prompt
    by_session: dict[int, wl.TraceRow] = {}
    for row in rows:
        prev = by_session.get(row.hash_ids[1])
        if prev is not None:
            assert row.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
        by_session[row.hash_ids[1]] = row


def test_the_sessions_preset_makes_history_matter() -> None:
    rows = generate_trace(TraceGenConfig(rows=1500, seed=0, **REUSE_PRESETS["sessions"]))
    given = wl.ideal_prefix_reuse(rows, 1000, 16)
    alone = wl.ideal_prefix_reuse(rows[1000:], 0, 16)
    assert given.token_fraction > alone.token_fraction + 0.2
    stats = wl.workload_stats(wl.trace_workload(rows, block=16))
    assert 190 <= stats.mean_input <= 240
    # the other presets are unchanged by the new knob (default 0)
    assert REUSE_PRESETS["light"] == {} and "session_rows" not in REUSE_PRESETS["heavy"]


def test_gen_trace_prints_the_ideal_reuse_given_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.jsonl"
    argv = f"gen-trace --out {out} --rows 300 --reuse sessions --session-rows 100"
    args = _parse([*argv.split(), "--history-rows", "200"])
    assert args.func(args) == 0
    rows = wl.read_trace(out)
    assert len(rows) == 300
    given = wl.ideal_prefix_reuse(rows, 200, 16)
    printed = capsys.readouterr().out
    assert f"rows 201-300: {given.token_fraction:.1%}" in printed
    assert max(i - s for i, s in _session_starts(rows)) < 100


# --- the reuse report -----------------------------------------------------------------------


def _result(name: str, cached: int | None, router: dict[str, float] | None) -> SystemResult:
    records = [
        RequestRecord(i, 0.0, 1.0, (0.5,), 0.5, prompt_tokens=50, output_tokens=1, cached_tokens=c)
        for i, c in enumerate([cached, cached] if cached is not None else [None, None])
    ]
    figures = RouterFigures(router, {}, {}) if router is not None else None
    history = HistoryOutcome(requests=4, served=4, retries=2, retried_for={"HTTP 429": 2})
    return SystemResult(name, "u", compute_metrics(records), figures, tuple(records), history)


def test_reuse_report_sets_each_system_beside_the_ideal() -> None:
    given = wl.PrefixReuse(10, 5, 100, 50, cache_reused_tokens=40)
    alone = wl.PrefixReuse(10, 2, 100, 20, cache_reused_tokens=0)
    plan = HistoryPlan(4, 2, 16, (), given, alone)
    router = {"store": 20.0, "prefix_cache": 10.0, "computed": 70.0}
    results = [_result("pdserve", 15, router), _result("colocated", 10, None)]
    doc = reuse_json(plan, results)
    assert doc["ideal_given_history"]["token_fraction"] == 0.5
    assert doc["ideal_without_history"]["fraction"] == 0.2
    pd = doc["systems"]["pdserve"]
    assert (pd["prompt_tokens"], pd["cached_tokens"]) == (100, 30)
    assert pd["cached_share"] == pytest.approx(0.3) and pd["of_ideal"] == pytest.approx(0.6)
    assert pd["of_cache_ideal"] == pytest.approx(0.75)  # 30% of the 40% whole blocks hold
    assert doc["ideal_given_history"]["cache_fraction"] == 0.4
    assert (pd["store_share"], pd["local_share"]) == (0.2, 0.1)
    assert pd["history"]["served"] == 4 and pd["history"]["retried_for"] == {"HTTP 429": 2}
    base = doc["systems"]["colocated"]
    assert base["of_ideal"] == pytest.approx(0.4) and base["store_share"] is None
    text = format_reuse(plan, results)
    assert "given 4 rows of history: 50.0% of prompt tokens" in text
    assert "without history: 20.0%" in text
    line = next(x for x in text.splitlines() if x.startswith("pdserve"))
    assert line.split() == ["pdserve", "4/0", "30.0%", "60.0%", "75.0%", "20.0%", "10.0%"]
    assert "at the engines' 32-token cache blocks (what a block cache can serve): 40.0%" in text
    json.dumps(doc)  # serializable
    cold = HistoryPlan(4, 2, 16, (), given, alone, skipped=True)  # --skip-history
    doc = reuse_json(cold, results)
    assert doc["history_replayed"] is False
    assert doc["systems"]["pdserve"]["of_ideal"] == pytest.approx(1.5)  # 30% of 20%
    assert doc["systems"]["pdserve"]["of_cache_ideal"] is None  # no whole block to reuse
    assert "history of 4 rows skipped (caches cold): 20.0%" in format_reuse(cold, results)


# --- GPU-shaped memory ----------------------------------------------------------------------


def test_as_shipped_by_default() -> None:
    args = _parse([])
    assert args.baseline_kv_cache_gib is None
    resolve_memory(args)
    assert args.baseline_kv_cache_gib == 2.0
    assert pdserve_env(args, {}) == {}
    assert memory_shape(args)["shape"] == "as shipped"
    assert "--num-gpu-blocks-override" not in args.baseline_args


def test_one_engine_cache_for_both_systems() -> None:
    args = _parse(["--engine-kv-cache-gib", "1", "--start-pdserve", ""])
    resolve_memory(args)
    assert args.baseline_kv_cache_gib == 1.0
    assert pdserve_env(args, {}) == {
        "PDSERVE_PREFILL_VLLM_KV_CACHE_GIB": "1",
        "PDSERVE_DECODE_VLLM_KV_CACHE_GIB": "1",
    }
    assert memory_shape(args)["shape"] == "gpu-shaped"
    assert "every engine's own KV cache 1 GiB" in describe_shape(args)
    own = _parse(["--engine-kv-cache-gib", "1", "--baseline-kv-cache-gib", "3"])
    resolve_memory(own)
    assert own.baseline_kv_cache_gib == 3.0  # the baseline's own flag wins
    with pytest.raises(SystemExit):
        _parse(["--engine-kv-cache-gib", "0.5"])  # vLLM on CPU takes whole GiB


def test_engine_cache_in_blocks_for_both_systems() -> None:
    args = _parse(["--engine-kv-blocks", "256"])
    resolve_memory(args)
    resolve_memory(args)  # once only
    assert args.baseline_args.count("--num-gpu-blocks-override 256") == 1
    env = pdserve_env(args, {"PDSERVE_DECODE_VLLM_ARGS": '{"enforce_eager": true}'})
    assert json.loads(env["PDSERVE_DECODE_VLLM_ARGS"]) == {
        "enforce_eager": True,
        "num_gpu_blocks_override": 256,
    }
    assert json.loads(env["PDSERVE_PREFILL_VLLM_ARGS"]) == {"num_gpu_blocks_override": 256}
    assert "--target's engines stay" in describe_shape(args)


def test_the_comparison_table_keeps_a_long_baseline_name_apart() -> None:
    from pdserve.bench.serve.report import format_comparison

    text = format_comparison(_result("pdserve", 15, None), _result("colocated-router", 10, None))
    header = next(x for x in text.splitlines() if x.startswith("metric"))
    assert header.split() == ["metric", "pdserve", "colocated-router", "ratio", "better"]
    cached = next(x for x in text.splitlines() if x.startswith("prompt tokens from cache"))
    assert cached.split()[-2:] == ["30", "20"]
