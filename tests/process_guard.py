"""`make check` runs the tests that start no process (`-m "not slow"`). With
``PDSERVE_NO_PROCESSES=1`` (which `make check` sets), a test not marked ``slow`` that starts a
process (``subprocess``, ``multiprocessing``; its fixtures included) fails at once, saying so:
the fast set cannot grow slow unnoticed. Its hooks are tests/conftest.py's."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

import pytest

ENV = "PDSERVE_NO_PROCESSES"
_current: list[pytest.Item] = []


def _guard(what: str) -> None:
    item = _current[-1] if _current else None
    if item is not None and item.get_closest_marker("slow") is None:
        raise AssertionError(
            f"{item.nodeid} starts a process ({what}) but is not marked slow: mark it "
            "@pytest.mark.slow (or the module, pytestmark), so that `make check` stays the set "
            "of tests that start no process"
        )


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(ENV) != "1":
        return
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def guarded_popen(self: subprocess.Popen, args: Any, *a: Any, **kw: Any) -> None:
        _guard(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:80]}")
        popen_init(self, args, *a, **kw)

    def guarded_start(self: multiprocessing.process.BaseProcess) -> None:
        _guard(f"multiprocessing {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()
