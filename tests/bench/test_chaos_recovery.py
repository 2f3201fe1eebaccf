"""``pdserve bench chaos``'s recovery figures, from recorded answers (no cluster), and one run
with two KV masters (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.bench.chaos import Outcome
from pdserve.bench.chaos_recovery import store_served_s

REFS = ["right 0", "right 1"]


def _answer(start: float, end: float, cached: int, *, prompt: int = 0, ok: bool = True) -> Outcome:
    return Outcome(start, end, prompt, 200 if ok else 503, REFS[prompt] if ok else "", cached)


def test_store_served_counts_from_the_fault_to_the_first_answer_that_stays_from_the_store():
    answers = [
        _answer(9.0, 10.5, 16),  # sent before the fault: left out
        _answer(10.1, 10.2, 0),  # recomputed: the store was out of reach
        _answer(10.2, 12.0, 16),  # sent early, answered late: from the store...
        _answer(11.0, 12.1, 0, prompt=1),  # ...but a later answer was not
        _answer(12.2, 12.5, 16, prompt=1),  # from here on every answer loads from the store
        _answer(12.3, 12.6, 32),
        _answer(12.0, 13.0, 16, prompt=-1),  # unscored (fresh prompts): left out
    ]
    assert store_served_s(answers, REFS, 10.0) == 2.5


def test_a_wrong_or_failed_answer_after_the_fault_starts_the_count_over():
    wrong = Outcome(10.6, 10.7, 1, 200, "wrong", 16)
    answers = [_answer(10.1, 10.5, 16), wrong, _answer(10.8, 11.0, 16)]
    assert store_served_s(answers, REFS, 10.0) == 1.0
    assert store_served_s([*answers, _answer(11.1, 11.2, 16, ok=False)], REFS, 10.0) is None
    assert store_served_s([], REFS, 10.0) is None


@pytest.mark.slow
def test_chaos_with_two_masters_serves_from_the_store_again_after_each_leader_fault(tmp_path):
    """`pdserve bench chaos --kvstore-masters 2`: the leader's SIGKILL and SIGSTOP lose no
    request, answer nothing wrong, lose no stored object, and prompts are served from the
    store again after each (a figure is reported); a killed node comes back (restart figure)."""
    from pdserve.commands.etcd import binary

    if binary() is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    out = tmp_path / "chaos.json"
    cmd = [
        sys.executable, "-m", "pdserve.commands.cli", "bench", "chaos", "--kvstore-masters", "2",
        "--faults", "master,stall,node", "--stall-s", "3", "--phase-s", "10",
        "--run-dir", str(tmp_path / "run"), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["fault"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"master", "stall", "node"}
    for row in rows.values():
        assert row["requests"] > 0 and row["exact"] == row["requests"], row
        assert (row["wrong"], row["hung"], row["markers_lost"]) == (0, 0, 0), row
        assert row["store_s"] is not None, row  # served from the store again
    assert rows["master"]["notes"][0].endswith(" led")  # the leader was the one hit
    assert rows["master"]["restart_s"] is not None and rows["node"]["restart_s"] is not None
