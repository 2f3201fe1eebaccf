"""One benchmark phase in a fresh engine process (stdlib imports only).

A bench module runs ``python -m <module> --worker SPEC.json OUT.json`` through
:func:`run_phase`; its ``main`` hands that argv to :func:`worker_main` with its own async
phase function, which reads the spec, runs with one torch thread, and writes the result."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def run_phase(module: str, tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs ``spec`` in a fresh ``python -m module --worker`` process; its log is
    ``tmp/<name>.log``, quoted when it fails."""
    spec_path, out_path, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with log.open("w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", module, "--worker", str(spec_path), str(out_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
    if rc != 0:
        raise SystemExit(f"{name} engine failed, see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(out_path.read_text())


def worker_main(
    phase: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], spec_path: str, out_path: str
) -> int:
    """The ``--worker`` side of :func:`run_phase`."""
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(asyncio.run(phase(spec))))
    return 0
