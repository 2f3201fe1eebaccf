"""Rooms stay small by themselves: no Python file of the repository over 600 lines, and a file
over 450 may only shrink. ``tests/room_sizes.json`` records the files over 450 lines with their
length; a file there that grew, or a file over 450 that is not there, fails with what to do
(split it by concept, or shrink it). When a listed file shrinks, lower its entry (or drop it
once it is 450 or less): the record only ever goes down. Generated protobuf modules are left
out (``make protos`` writes them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "room_sizes.json"
CAP, WATCH = 600, 450
SKIP = {"__pycache__", "build", "dist", "node_modules", "venv", "pdserve.egg-info"}


def _sizes() -> dict[str, int]:
    """Each Python file's lines, below the repository root (hidden folders, virtual
    environments, build outputs and caches left out)."""
    out = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP]
        for name in files:
            if name.endswith(".py") and not name.endswith(("_pb2.py", "_pb2_grpc.py")):
                path = Path(folder, name)
                rel = path.relative_to(ROOT).as_posix()
                out[rel] = len(path.read_text(encoding="utf-8").splitlines())
    return out


def check(sizes: dict[str, int], record: dict[str, int]) -> list[str]:
    """What is wrong with ``sizes`` against the cap and ``record``, one line each."""
    problems = []
    for rel, n in sorted(sizes.items()):
        if n > CAP:
            problems.append(f"{rel}: {n} lines, over the cap of {CAP}: split it by concept")
        elif n > WATCH and rel not in record:
            problems.append(
                f"{rel}: {n} lines, over {WATCH} and not in {RECORD.name}: split it, or shrink "
                f"it to {WATCH}"
            )
        elif n > WATCH and n > record[rel]:
            problems.append(
                f"{rel}: {n} lines, was {record[rel]}: a file over {WATCH} may only shrink"
            )
    return problems


def test_the_rooms_stay_small() -> None:
    sizes = _sizes()
    assert len(sizes) > 300  # the scan found the repository
    problems = check(sizes, json.loads(RECORD.read_text()))
    assert not problems, "\n".join(problems)


def test_the_record_only_lists_files_over_the_watch_line() -> None:
    """An entry for a file that shrank to 450 or less (or went away) is dropped, and an entry
    is never above the file: the record goes down with the files."""
    sizes = _sizes()
    record = json.loads(RECORD.read_text())
    stale = {rel: n for rel, n in record.items() if sizes.get(rel, 0) <= WATCH}
    assert not stale, f"drop these entries of {RECORD.name}: {stale}"
    loose = {rel: (n, sizes[rel]) for rel, n in record.items() if sizes[rel] < n}
    assert not loose, f"lower these entries of {RECORD.name} to the file's length: {loose}"


def test_the_check_names_each_way_to_fail() -> None:
    record = {"a.py": 500}
    assert check({"a.py": 500, "b.py": 450, "c.py": 10}, record) == []
    assert check({"a.py": 501}, record) == [
        "a.py: 501 lines, was 500: a file over 450 may only shrink"
    ]
    assert "not in room_sizes.json" in check({"b.py": 451}, record)[0]
    assert "over the cap of 600" in check({"a.py": 601}, record)[0]
