"""Files stay small: no Python file of pdserve/, services/ or tests/ over :data:`LIMIT` lines,
and one over :data:`WATCH` lines only shrinks. :data:`BASELINE` holds those over WATCH when
this test came in, with their line counts then: such a file may not grow past its count, a file
not in it may not cross WATCH, and an entry whose file is gone or back under WATCH fails until
it is removed (so the list only shrinks). A file near the limit wants splitting by concept
(STYLE.md); generated protobuf code (``*_pb2*.py``) is not counted."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pdserve", "services", "tests")
#: No file is longer.
LIMIT = 600
#: Longer files may only shrink (BASELINE).
WATCH = 450
#: Files over WATCH lines on 2026-12-07, and their line counts then (may only go down).
BASELINE: dict[str, int] = {
    "pdserve/commands/up_cluster.py": 516,
    "pdserve/engines/vllm_engine.py": 562,
    "pdserve/integrations/lmcache.py": 527,
    "services/kvstore/master/kv_events.py": 553,
    "services/kvstore/master/servicer.py": 467,
    "services/kvstore/master/state.py": 572,
    "services/router/frontend.py": 511,
    "services/router/orchestrator.py": 460,
    "tests/bench/serve/test_capacity.py": 463,
    "tests/deploy/test_k8s.py": 538,
    "tests/kvstore/master/test_kv_events.py": 457,
    "tests/kvstore/master/test_kv_events_engine.py": 452,
    "tests/kvstore/master/test_state.py": 566,
    "tests/multihost/test_netns_cluster.py": 536,
    "tests/router/test_api.py": 476,
    "tests/router/test_api_params.py": 475,
    "tests/store/test_transport_roundtrip.py": 459,
}


def line_counts(root: Path) -> dict[str, int]:
    """Lines of every counted ``.py`` file under ``root``'s :data:`FOLDERS`, by relative path."""
    return {
        path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for folder in FOLDERS
        for path in sorted((root / folder).rglob("*.py"))
        if "_pb2" not in path.name
    }


def size_problems(counts: dict[str, int], baseline: dict[str, int]) -> list[str]:
    """What breaks the rules above, one line each (empty: nothing)."""
    problems = []
    for path, n in sorted(counts.items()):
        if n > LIMIT:
            problems.append(f"{path}: {n} lines, over the limit of {LIMIT}: split it by concept")
        elif path in baseline and n > baseline[path]:
            problems.append(
                f"{path}: {n} lines, more than its {baseline[path]}: it may only shrink"
            )
        elif path not in baseline and n > WATCH:
            problems.append(
                f"{path}: {n} lines, over {WATCH}: move a concept out to a new module first"
            )
    for path in sorted(baseline):
        if counts.get(path, 0) <= WATCH:
            problems.append(f"{path}: gone or at most {WATCH} lines now: remove it from BASELINE")
    return problems


def test_no_file_is_too_long_and_long_ones_only_shrink() -> None:
    counts = line_counts(ROOT)
    assert "pdserve/config.py" in counts and "tests/test_sizes.py" in counts
    assert "pdserve/v1/kvstore_pb2_grpc.py" not in counts
    problems = size_problems(counts, BASELINE)
    assert not problems, "\n".join(problems)


def test_the_rules_catch_each_kind_of_growth() -> None:
    base = {"a.py": 500, "shrunk.py": 470}
    counts = {"a.py": 501, "b.py": 451, "c.py": 601, "shrunk.py": 450, "ok.py": 450}
    assert size_problems(counts, base) == [
        "a.py: 501 lines, more than its 500: it may only shrink",
        "b.py: 451 lines, over 450: move a concept out to a new module first",
        "c.py: 601 lines, over the limit of 600: split it by concept",
        "shrunk.py: gone or at most 450 lines now: remove it from BASELINE",
    ]
    assert size_problems({"a.py": 480, "shrunk.py": 470}, base) == []
