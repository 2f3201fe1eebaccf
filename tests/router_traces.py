"""The router's per-request trace lines, read from its log file (a test helper for the
clusters that tests start: tests/cluster_harness.py, tests/store/test_mooncake_services.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def read_router_traces(log_path: Path, *wait_for: str, timeout_s: float = 10.0) -> dict[str, dict]:
    """The trace lines in the router's log ``log_path``, by request id, once the lines of the
    ids in ``wait_for`` are there: the router logs a request's line as its stream ends, and a
    thread of the test process copies the router's output into the log file, so a line can
    land a moment after the caller saw the stream end."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = {}
        for line in log_path.read_text().splitlines():
            try:
                msg = json.loads(line)["msg"]
            except (ValueError, KeyError):
                continue
            if msg.startswith("request "):
                _, rid, outcome, body = msg.split(" ", 3)
                out[rid] = {"outcome": outcome, **json.loads(body)}
        missing = [r for r in wait_for if r not in out]
        if not missing:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"no router trace line for {missing} in {timeout_s:g} s")
        time.sleep(0.05)
