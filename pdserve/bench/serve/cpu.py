"""Where the cores went during a measured window: the CPU time of every process the benchmark
started (the system under test and its children, or a baseline's engines and router), read
from ``/proc`` before and after the window, grouped by role.

Every system ``bench serve`` starts is a descendant of the benchmark's own process and only
one system is up at a time, so the descendants are that system; the benchmark's own client
(this process) is reported beside it, since it takes the same cores. A role is named from a
process's command line: pdserve's services (``router``, ``decode``, ``kvstore node``, ...),
vLLM's processes by their titles (``VLLM::EngineCore``: the engine's scheduler, and with it the
connector's scheduler side; ``VLLM::Worker``: the model's forward, and the connector's worker
side), ``vllm serve``'s API server, the round-robin proxy and ``vllm-router``.

The summary splits the window's CPU into the engines (the vLLM processes: forward and
scheduling) and everything else that serves requests (API servers, pdserve's router and
worker services, the store, meta, proxies): the latter per completed request is the control
plane's CPU per request. Linux only; elsewhere the report says it is not available.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
#: vLLM's process titles (``setproctitle``; ``comm`` holds their first 15 bytes).
ENGINE_TITLES = {"VLLM::EngineCor": "vllm engine core", "VLLM::Worker": "vllm model runner"}
#: pdserve CLI words that name a service, longest first.
_PDSERVE_ROLES = (
    ("kvstore master", ("kvstore", "master")),
    ("kvstore node", ("kvstore", "node")),
    ("router", ("router",)),
    ("decode", ("decode",)),
    ("prefill", ("prefill",)),
    ("meta", ("meta",)),
    ("up", ("up",)),
)


@dataclass(frozen=True)
class CpuSample:
    """Each process's CPU seconds (user + system) and role, at ``t`` (monotonic seconds)."""

    t: float
    cpu_s: dict[int, tuple[str, float]]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: fields start after its ")"
    return raw[raw.rindex(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def descendants(root: int) -> list[int]:
    """Every live process below ``root``."""
    kids, out, todo = _children(), [], [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def role(pid: int) -> str:
    """What ``pid`` is, from its title or command line ("other" when unknown)."""
    try:
        comm = (PROC / str(pid) / "comm").read_text().strip()
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if comm in ENGINE_TITLES:
        return ENGINE_TITLES[comm]
    words = [a.decode(errors="replace") for a in argv if a]
    return role_of(words)


def role_of(argv: list[str]) -> str:
    """The role of a command line (see the module docstring)."""
    joined = " ".join(argv)
    if "resource_tracker" in joined:
        return "other"
    if "pdserve.commands.cli" in argv:
        rest = argv[argv.index("pdserve.commands.cli") + 1 :]
        for name, words in _PDSERVE_ROLES:
            if tuple(rest[: len(words)]) == words:
                return name
        return "pdserve (other)"
    if "pdserve.bench.serve.proxy" in argv:
        return "round-robin proxy"
    if any(Path(a).name == "vllm-router" for a in argv[:1]):
        return "vllm-router"
    vllm_cli = "pdserve.commands.vllm" in argv or any(Path(a).name == "vllm" for a in argv[:2])
    if vllm_cli and "serve" in argv:
        return "vllm api server"
    return "other"


def cpu_seconds(pid: int) -> float | None:
    fields = _stat_fields(pid)
    if fields is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def sample(root: int, now: float) -> CpuSample:
    """The CPU seconds of ``root`` (as "bench client") and of every process below it."""
    out: dict[int, tuple[str, float]] = {}
    own = cpu_seconds(root)
    if own is not None:
        out[root] = ("bench client", own)
    for pid in descendants(root):
        spent = cpu_seconds(pid)
        if spent is not None:
            out[pid] = (role(pid), spent)
    return CpuSample(now, out)


@dataclass(frozen=True)
class CpuReport:
    """The window's CPU by role (seconds), its length and the requests it completed."""

    window_s: float
    by_role: dict[str, float]
    requests: int
    cores: int

    @property
    def engine_s(self) -> float:
        return sum(v for k, v in self.by_role.items() if k in ENGINE_TITLES.values())

    @property
    def serving_s(self) -> float:
        """Everything but the engines and the benchmark's own client."""
        skip = {*ENGINE_TITLES.values(), "bench client"}
        return sum(v for k, v in self.by_role.items() if k not in skip)

    def to_json(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "cores": self.cores,
            "requests": self.requests,
            "cpu_s_by_role": self.by_role,
            "engines_busy_cores": self.engine_s / self.window_s if self.window_s else None,
            "control_plane_cpu_ms_per_request": (
                1000 * self.serving_s / self.requests if self.requests else None
            ),
        }


def cpu_report(before: CpuSample, after: CpuSample, requests: int) -> CpuReport:
    """The CPU spent between two samples by role; a process born in between counts from 0."""
    by_role: dict[str, float] = {}
    for pid, (name, spent) in after.cpu_s.items():
        start = before.cpu_s.get(pid, (name, 0.0))[1]
        by_role[name] = by_role.get(name, 0.0) + max(0.0, spent - start)
    return CpuReport(after.t - before.t, by_role, requests, os.cpu_count() or 1)


def format_cpu(report: CpuReport) -> Iterable[str]:
    """The report's lines for a system's result table."""
    w = report.window_s or 1.0
    for name, spent in sorted(report.by_role.items(), key=lambda kv: -kv[1]):
        yield f"  {name:<30}{spent / w:>8.2f} cores ({spent:.1f} s)"
    doc = report.to_json()
    yield (
        f"  engines busy {doc['engines_busy_cores']:.2f} of {report.cores} cores; "
        f"control plane {doc['control_plane_cpu_ms_per_request'] or 0:.1f} ms CPU per request"
    )
