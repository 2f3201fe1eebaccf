"""Where each worker of ``pdserve up`` runs: a GPU of its own, or a CPU core of its own.

A pure function of what is visible and the topology (:func:`place_workers`), so that what a
machine with GPUs gets is decided, and tested, on a machine without one:

- vLLM workers on a machine with visible NVIDIA GPUs get one GPU each
  (``CUDA_VISIBLE_DEVICES`` set to that one device, in the order the machine lists them).
  vLLM sizes its KV cache from a share of the whole GPU (``gpu_memory_utilization``), so two
  engines on one GPU do not fit: more vLLM workers than GPUs is refused with the numbers.
- Without GPUs, each vLLM worker is pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``), round
  robin: vLLM pins its OpenMP threads, and two engines on one core halve each other. The
  worker's whole process tree goes there too (:func:`pin_process`, before the engine
  starts): vLLM's engine-core process busy-waits (``sched_yield``) on its shared-memory queue
  while its model process computes a step, and unpinned the kernel may run it on any core,
  the other engine's included.
- The torch engine runs on the CPU and is left alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    """One worker's share of the machine."""

    #: environment the worker starts with (``CUDA_VISIBLE_DEVICES``)
    env: dict[str, str] = field(default_factory=dict)
    #: the worker's ``vllm_cpu_cores`` (None: not pinned)
    cpu_cores: str | None = None


def visible_gpus(environ: Mapping[str, str], dev_dir: str | Path = "/dev") -> list[str]:
    """The NVIDIA GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: that
    variable's list when it is set (up to an entry that hides the rest, as CUDA reads it),
    else the ``/dev/nvidiaN`` devices."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        out = []
        for entry in (e.strip() for e in listed.split(",")):
            if not entry or entry.startswith("-"):
                break  # CUDA ignores this entry and every one after it
            out.append(entry)
        return out
    found = [p.name for p in Path(dev_dir).glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return sorted((name.removeprefix("nvidia") for name in found), key=int)


def place_workers(
    workers: Sequence[tuple[str, int]], *, engine: str, gpus: Sequence[str], cores: int
) -> list[Placement]:
    """Each worker's :class:`Placement` (see the module docstring); ``workers`` in start
    order. Raises ValueError when vLLM workers outnumber the GPUs."""
    if engine != "vllm":
        return [Placement() for _ in workers]
    if gpus:
        if len(workers) > len(gpus):
            raise ValueError(
                f"{len(workers)} vLLM workers on {len(gpus)} visible GPU(s) "
                f"({','.join(gpus)}): each vLLM engine needs a GPU of its own; start at most "
                f"{len(gpus)} (prefill_workers + decode_workers) or make more GPUs visible"
            )
        return [Placement(env={"CUDA_VISIBLE_DEVICES": gpu}) for gpu in gpus[: len(workers)]]
    return [Placement(cpu_cores=str(n % max(cores, 1))) for n in range(len(workers))]


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (x86 ``flags``: ``avx512f``, ``avx512_bf16``, ``amx_tile``...;
    Arm ``Features``: ``asimd``, ``bf16``...); empty where /proc/cpuinfo has neither."""
    try:
        found = re.search(r"^(?:flags|Features)\s*:(.*)$", Path(cpuinfo).read_text(), re.M)
    except OSError:
        return frozenset()
    return frozenset(found[1].split()) if found else frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16). Without it
    vLLM's CPU backend runs bfloat16 matmuls through a generic fallback, slowly and with
    rounding that depends on the batch's shape."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def vllm_auto_dtype(
    environ: Mapping[str, str], flags: frozenset[str] | None = None, dev_dir: str | Path = "/dev"
) -> str:
    """The model and KV dtype pdserve's vLLM workers run in when ``kv_dtype`` is auto.

    bfloat16 (what ``vllm serve`` picks for a float32 or bfloat16 model) on a visible GPU, on
    a CPU that computes bfloat16 natively, and where the CPU's flags cannot be read. float32
    on a CPU without native bfloat16 (x86 with AVX2 or AVX-512F only): vLLM's fallback there
    runs bfloat16 matmuls about 6x slower than float32 (docs/benchmarks.md, "Capacity at SLO"), which
    outweighs its KV chunks being twice the bytes."""
    if visible_gpus(environ, dev_dir):
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if not flags or native_bf16(flags) else "float32"


#: ``VLLM_CPU_OMP_THREADS_BIND`` values that name no cores (vLLM binds by itself, or not at
#: all): a worker given one is not pinned.
UNPINNED = frozenset({"auto", "nobind", "all"})


def parse_cores(spec: str) -> set[int]:
    """The cores of a ``vllm_cpu_cores`` / ``VLLM_CPU_OMP_THREADS_BIND`` value: ``"0"``,
    ``"0-3"``, ``"0,2"``, and vLLM's ``"0|1"`` (one list per tensor-parallel rank; all of
    them); none for :data:`UNPINNED`. Raises ValueError on anything else."""
    if spec.strip() in UNPINNED:
        return set()
    cores: set[int] = set()
    for part in re.split(r"[,|]", spec):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        lo = int(m[1]) if m else 0
        hi = int(m[2]) if m and m[2] else lo
        if m is None or hi < lo:
            raise ValueError(
                f"cpu cores {spec!r}: {part!r} is not a core or a range a-b "
                f"(or one of {sorted(UNPINNED)})"
            )
        cores.update(range(lo, hi + 1))
    return cores


def pin_process(spec: str) -> set[int]:
    """Pins this process, and so every process it starts later, to the cores of ``spec``
    (:func:`parse_cores`) that it may use; returns them (empty: nothing changed, where
    none of them is allowed, ``spec`` names none, or the platform cannot pin)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cores = parse_cores(spec) & os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    return cores
