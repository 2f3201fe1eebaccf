"""``pdserve bench serve`` takes ``vllm bench serve``'s spellings of its flags: the same run as
pdserve's own spellings, and ``--save-result`` writes where vLLM's would; ``--baseline-pin``
pins the baseline's engines, their children included."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.bench.serve.cli import add_arguments
from pdserve.bench.serve.run import result_path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


#: Flags both tools spell alike.
SHARED = ["--num-prompts", "12", "--request-rate", "2", "--max-concurrency", "4", "--seed", "5"]


def test_vllm_bench_serve_spellings_mean_the_same_run() -> None:
    vllm = _parse(
        [
            "--base-url",
            "http://h:1",
            "--dataset-name",
            "prefix_repetition",
            "--random-input-len",
            "77",
            "--random-output-len",
            "9",
            "--random-range-ratio",
            "0.5",
            "--prefix-repetition-num-prefixes",
            "3",
            "--prefix-repetition-prefix-len",
            "40",
            "--prefix-repetition-suffix-len",
            "8",
            *SHARED,
        ]
    )
    ours = _parse(
        [
            "--target",
            "http://h:1",
            "--workload",
            "prefix-repetition",
            "--input-len",
            "77",
            "--output-len",
            "9",
            "--range-ratio",
            "0.5",
            "--num-prefixes",
            "3",
            "--prefix-len",
            "40",
            "--suffix-len",
            "8",
            *SHARED,
        ]
    )
    assert vars(vllm) == vars(ours)
    assert ours.workload == "prefix-repetition" and ours.suffix_len == 8
    assert _parse(["--prefix-repetition-output-len", "3"]).output_len == 3


def test_save_result_writes_where_vllm_would(tmp_path: Path) -> None:
    assert result_path(_parse([])) == ""
    assert result_path(_parse(["--json", "a.json", "--save-result"])) == "a.json"
    named = _parse(f"--save-result --result-dir {tmp_path} --result-filename r.json".split())
    assert result_path(named) == str(tmp_path / "r.json")
    default = Path(result_path(_parse(["--save-result", "--dataset-name", "random"])))
    assert default.parent == Path(".") and default.name.startswith("pdserve-random-")


def test_the_baseline_is_pinned_only_when_asked() -> None:
    assert _parse([]).baseline_pin is False
    assert _parse(["--baseline-pin"]).baseline_pin is True


@pytest.mark.slow
def test_a_spawned_engine_and_its_children_run_on_the_cores_given(tmp_path: Path) -> None:
    import json
    import os
    import sys

    from pdserve.bench.serve.harness import spawn

    before = os.sched_getaffinity(0)
    core = max(before)
    child = (
        "import json, os, subprocess, sys; kid = subprocess.run([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, "
        "text=True).stdout; print(json.dumps([sorted(os.sched_getaffinity(0)), json.loads(kid)]))"
    )
    proc = spawn("pinned", [sys.executable, "-c", child], tmp_path / "pinned.log", cores={core})
    assert proc.popen.wait(60) == 0
    assert json.loads((tmp_path / "pinned.log").read_text()) == [[core], [core]]
    assert os.sched_getaffinity(0) == before  # this process is left as it was
