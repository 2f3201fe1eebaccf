"""Where `pdserve up` puts each worker: a pure function of the visible GPUs and the topology,
tested here on machines that have none (docs/deploy.md says what has run on a GPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve import devices
from pdserve.commands.up import UpConfig
from pdserve.devices import Placement, place_workers, visible_gpus

TWO = [("decode", 0), ("decode", 1)]


def test_vllm_workers_get_a_gpu_each_in_the_order_listed() -> None:
    places = place_workers(
        [("prefill", 0), *TWO], engine="vllm", gpus=["3", "1", "GPU-abc"], cores=16
    )
    assert [p.env for p in places] == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "GPU-abc"},
    ]
    assert all(p.cpu_cores is None for p in places)  # not pinned to cores on a GPU


def test_more_vllm_workers_than_gpus_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"3 vLLM workers on 2 visible GPU\(s\) \(0,1\)"):
        place_workers([("prefill", 0), *TWO], engine="vllm", gpus=["0", "1"], cores=16)


def test_without_gpus_vllm_workers_are_pinned_a_core_each_round_robin() -> None:
    places = place_workers([*TWO, ("decode", 2)], engine="vllm", gpus=[], cores=2)
    assert [p.cpu_cores for p in places] == ["0", "1", "0"]
    assert all(p.env == {} for p in places)


def test_the_torch_engine_is_left_alone() -> None:
    assert place_workers(TWO, engine="torch", gpus=["0"], cores=2) == [Placement(), Placement()]


@pytest.mark.parametrize(
    "listed,want",
    [("0,1", ["0", "1"]), ("", []), ("2, 0", ["2", "0"]), ("1,-1,0", ["1"]), ("GPU-a", ["GPU-a"])],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(listed: str, want: list[str]) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": listed}) == want


def test_without_the_variable_the_nvidia_device_files_count(tmp_path: Path) -> None:
    for name in ("nvidia1", "nvidia0", "nvidia10", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, tmp_path) == ["0", "1", "10"]
    assert visible_gpus({}, tmp_path / "none") == []


def test_the_default_topology_is_a_worker_per_gpu_else_per_core(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    on_gpus = UpConfig(engine="vllm")
    on_gpus.resolve(["0", "1"])
    assert (on_gpus.prefill_workers, on_gpus.decode_workers) == (0, 2)
    on_cpu = UpConfig(engine="vllm")
    on_cpu.resolve([])
    assert (on_cpu.prefill_workers, on_cpu.decode_workers) == (0, 8)
    torch_on_gpus = UpConfig(engine="torch")
    torch_on_gpus.resolve(["0"])
    assert torch_on_gpus.decode_workers == 8


def test_workers_are_listed_in_start_order_for_placement() -> None:
    cfg = UpConfig(engine="vllm", prefill_workers=1, decode_workers=2)
    cfg.resolve(["0", "1", "2"])
    assert cfg.workers() == [("prefill", 0), ("decode", 0), ("decode", 1)]
    places = place_workers(cfg.workers(), engine=cfg.engine, gpus=["0", "1", "2"], cores=2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["0", "1", "2"]


def test_a_cluster_that_cannot_be_placed_is_refused_before_anything_starts(
    monkeypatch, tmp_path: Path
) -> None:
    from pdserve.commands.up_cluster import Cluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = UpConfig(engine="vllm", decode_workers=2, run_dir=str(tmp_path))
    cfg.resolve()
    with pytest.raises(ValueError, match=r"2 vLLM workers on 1 visible GPU"):
        Cluster(cfg, None)
    assert not (tmp_path / "logs").exists()  # nothing started
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    placed = Cluster(cfg, None).places
    assert [p.cpu_cores for p in placed] == [str(n % (os.cpu_count() or 1)) for n in range(2)]


@pytest.mark.parametrize(
    ("flags", "environ", "want"),
    [
        ({"avx2", "fma"}, {}, "float32"),  # AVX2 only: bfloat16 runs in a slow fallback
        ({"avx512f", "avx512bw"}, {}, "float32"),  # AVX-512 without its bfloat16 extension
        ({"avx512f", "avx512_bf16"}, {}, "bfloat16"),
        ({"avx512f", "amx_tile", "amx_bf16"}, {}, "bfloat16"),
        ({"asimd", "bf16"}, {}, "bfloat16"),  # Arm with bfloat16
        ({"asimd"}, {}, "float32"),
        (set(), {}, "bfloat16"),  # flags unknown: vLLM's own choice
        ({"avx2"}, {"CUDA_VISIBLE_DEVICES": "0"}, "bfloat16"),  # the GPU computes
    ],
)
def test_vllm_workers_pick_float32_on_cpus_without_native_bfloat16(
    flags: set[str], environ: dict[str, str], want: str, tmp_path: Path
) -> None:
    from pdserve.devices import vllm_auto_dtype

    assert vllm_auto_dtype(environ, frozenset(flags), dev_dir=tmp_path) == want


def test_cpu_flags_reads_x86_flags_and_arm_features(tmp_path: Path) -> None:
    from pdserve.devices import cpu_flags

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "fma"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_vllm_engines_auto_kv_dtype_follows_this_machine(monkeypatch) -> None:
    from pdserve.devices import vllm_auto_dtype
    from pdserve.engines.config import EngineConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert EngineConfig(engine="vllm").resolved_kv_dtype() == vllm_auto_dtype({})
    assert EngineConfig(engine="vllm", kv_dtype="bfloat16").resolved_kv_dtype() == "bfloat16"
    assert EngineConfig(engine="torch").resolved_kv_dtype() == "float32"


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("0", {0}),
        ("1", {1}),
        ("0-3", {0, 1, 2, 3}),
        ("0,2", {0, 2}),
        ("0|1", {0, 1}),
        (" 2 ", {2}),
        ("auto", set()),
        ("nobind", set()),
    ],
)
def test_core_lists_parse_as_vllm_reads_them(spec: str, want: set[int]) -> None:
    assert devices.parse_cores(spec) == want


@pytest.mark.parametrize("spec", ["", "a", "3-1", "0-", "1;2"])
def test_a_bad_core_list_is_refused_with_what_is_wrong(spec: str) -> None:
    with pytest.raises(ValueError, match="is not a core or a range"):
        devices.parse_cores(spec)


def test_a_bad_core_list_in_a_worker_config_is_refused_at_start() -> None:
    from pdserve.config import ConfigError
    from pdserve.engines.config import EngineConfig

    with pytest.raises(ConfigError, match=r"vllm_cpu_cores: .*'x' is not a core"):
        EngineConfig(engine="vllm", vllm_cpu_cores="0,x").validate()


@pytest.mark.slow
def test_a_pinned_process_and_its_children_run_on_the_named_cores_only() -> None:
    import json
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1]
    # in a child process, so this test's own affinity is left alone; it starts a grandchild
    script = (
        "import json, os, subprocess, sys\n"
        "from pdserve.devices import pin_process\n"
        f"got = sorted(pin_process({str(core)!r}))\n"
        "kid = subprocess.run([sys.executable, '-c', 'import os; print(sorted("
        "os.sched_getaffinity(0)))'], capture_output=True, text=True, check=True).stdout\n"
        "print(json.dumps([got, json.loads(kid)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [[core], [core]]
    # none of the cores allowed: nothing changes
    assert devices.pin_process(str(max(allowed) + 1)) == set()
    assert sorted(os.sched_getaffinity(0)) == allowed
