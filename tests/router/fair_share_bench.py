"""Fair shares under a flood (not a test): two tenants with equal shares on a real `pdserve up`
(SmolLM2, one vLLM worker per core, the store, the router with a tenants file and
``max_inflight``). The light tenant sends 10% of the cluster's capacity, alone, then beside a
heavy tenant sending 5x the capacity, then once more under the same flood from the heavy
tenant's own key (no fairness between them: one tenant's FIFO queue). Prints the light
tenant's TTFT p50/p99 in each phase and the ratio to alone (target: p99 within 1.3x), and
where all the phase's requests spent their time (the router's ``pdserve_router_phase_seconds``
means: queue, prefill, kv_transfer, decode, and the decode's time per output token).

    .venv/bin/python tests/router/fair_share_bench.py [--phase-s 30] [--max-inflight 4]
        [--fair-headroom N] [--max-queue N] [--tpot-target-ms MS]
        [--phases alone,flood_fair,flood_one_tenant] [--run-dir DIR]

Capacity is measured first: ``max_inflight`` requests kept in flight for ``--phase-s / 2``
seconds. Requests: 64 random prompt tokens, 16 greedy output tokens (ignore_eos), streamed
over the OpenAI HTTP API; the heavy tenant's requests still waiting when a phase ends are
cancelled (disconnects), those past the router's ``max_queue`` per tenant are refused (429).
Each phase starts from an empty queue. Each phase's five slowest light TTFTs are printed too;
``--run-dir`` keeps the services' logs, where the router's line per request (its tenant,
when it was received, admitted, and its first token) tells where a slow one waited.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.procs import free_ports

HEAVY, LIGHT = "h" * 16 + "-heavy-tenant", "l" * 16 + "-light-tenant"
PROMPT, OUT = 64, 16
PHASES = ["alone", "flood_fair", "flood_one_tenant"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def one(http: aiohttp.ClientSession, key: str, rng: random.Random) -> float | None:
    """One streamed completion; its TTFT in ms, None when refused or cut off."""
    body = {
        "model": "smollm2",
        "prompt": [rng.randrange(100, 40000) for _ in range(PROMPT)],
        "max_tokens": OUT,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post("/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            return None
        ttft = None
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = (time.perf_counter() - t0) * 1000.0
        return ttft


async def open_loop(http, key: str, rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; TTFTs (ms) of those served.
    Requests still running at the end are cancelled."""
    rng = random.Random(seed)
    tasks = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.ensure_future(one(http, key, rng)))
        await asyncio.sleep(min(rng.expovariate(rate), end - now))
    done, pending = await asyncio.wait(tasks, timeout=0)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done if not t.exception() and t.result() is not None]


async def capacity(http, concurrency: int, seconds: float) -> float:
    """Requests per second with ``concurrency`` kept in flight (the router's whole limit)."""
    rng = random.Random(1)
    count = 0
    end = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal count
        while time.monotonic() < end:
            if await one(http, HEAVY, rng) is not None:
                count += 1

    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return count / (time.monotonic() - t0)


async def phase_sums(http: aiohttp.ClientSession) -> dict[str, tuple[float, float]]:
    """The router's ``pdserve_router_phase_seconds`` (sum, count) by phase."""
    async with http.get("/metrics") as resp:
        text = await resp.text()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pdserve_router_phase_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[1]
            if kind in ("sum", "count"):
                out.setdefault(sample.labels["phase"], [0.0, 0.0])[kind == "count"] = sample.value
    return {phase: (v[0], v[1]) for phase, v in out.items()}


def phase_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per request of each phase between two :func:`phase_sums`, and the decode's
    time per output token."""
    means = {}
    for phase, (total, n) in after.items():
        t0, n0 = before.get(phase, (0.0, 0.0))
        if n > n0:
            means[f"{phase}_ms"] = round(1000.0 * (total - t0) / (n - n0), 1)
    if "decode_ms" in means:
        means["tpot_ms"] = round(means["decode_ms"] / (OUT - 1), 1)
    return means


async def measured(http: aiohttp.ClientSession, *loads) -> tuple[list[float], dict]:
    """Runs ``loads`` (open loops) together; the first's TTFTs and the phase means."""
    before = await phase_sums(http)
    ttfts, *_ = await asyncio.gather(*loads)
    return ttfts, phase_means(before, await phase_sums(http))


async def phases(base: str, args: argparse.Namespace) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(base, connector=conn, timeout=timeout) as http:
        await capacity(http, args.max_inflight, 5)  # warm-up
        cap = await capacity(http, args.max_inflight, args.phase_s / 2)
        light_rate, heavy_rate = 0.1 * cap, 5 * cap
        s = args.phase_s
        loads = {
            "alone": lambda: (open_loop(http, LIGHT, light_rate, s, seed=2),),
            "flood_fair": lambda: (
                open_loop(http, LIGHT, light_rate, s, seed=3),
                open_loop(http, HEAVY, heavy_rate, s, seed=4),
            ),
            "flood_one_tenant": lambda: (
                open_loop(http, HEAVY, light_rate, s, seed=5),  # the light load, heavy's key
                open_loop(http, HEAVY, heavy_rate, s, seed=6),
            ),
        }
        runs = {name: await measured(http, *loads[name]()) for name in args.phases}
    out = {"capacity_rps": cap, "light_rps": light_rate, "heavy_rps": heavy_rate}
    for name, (xs, means) in runs.items():
        out[name] = {
            "n": len(xs),
            "p50_ms": pct(xs, 0.5),
            "p99_ms": pct(xs, 0.99),
            "slowest_ms": [round(x) for x in sorted(xs)[-5:]],
            **means,
        }
    for name in runs.keys() - {"alone"}:
        if "alone" in runs:
            out[name]["p99_vs_alone"] = out[name]["p99_ms"] / out["alone"]["p99_ms"]
    return out


def up(run: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`pdserve up` on free ports with the two tenants; (its process, the HTTP base URL)."""
    (run / "tenants").write_text(f"heavy {HEAVY} share=1\nlight {LIGHT} share=1\n")
    headroom = {} if args.fair_headroom is None else {"fair_headroom": args.fair_headroom}
    engine = {} if args.tpot_target_ms is None else {"tpot_target_ms": args.tpot_target_ms}
    config = {
        "prefill": engine,
        "decode": engine,
        "router": {
            **headroom,
            "tenant_keys_file": str(run / "tenants"),
            "max_inflight": args.max_inflight,
            **({} if args.max_queue is None else {"max_queue": args.max_queue}),
            "http_max_conns_per_peer": 0,  # one client address sends both tenants' load
            "api_key_failures": 0,
        },
    }
    (run / "bench.json").write_text(json.dumps(config))
    meta, meta_http, master, grpc_port, http_port, etcd = free_ports(6)
    cmd = [
        str(Path(sys.executable).parent / "pdserve"), "up", "--config", str(run / "bench.json"),
        "--run-dir", str(run), "--no-tls", "--meta-port", str(meta), "--meta-http-port",
        str(meta_http), "--master-port", str(master), "--router-port", str(grpc_port),
        "--http-port", str(http_port), "--etcd-port", str(etcd),
    ]  # fmt: skip
    log = (run / "up.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{http_port}"


async def ready(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Waits until the router serves a completion (every worker up)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(base) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("pdserve up exited; see up.log in the run dir")
            try:
                if await one(http, LIGHT, random.Random(0)) is not None:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError("pdserve up did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--max-inflight", type=int, default=4)
    ap.add_argument(
        "--max-queue", type=int, help="requests a tenant may have waiting (default: the router's)"
    )
    ap.add_argument("--fair-headroom", type=int, help="the router's (default: its own, 4)")
    ap.add_argument("--tpot-target-ms", type=float, help="the workers' (default: their own)")
    ap.add_argument(
        "--phases",
        type=lambda text: text.split(","),
        default=PHASES,
        help=f"which light phases to run, in order (default: {','.join(PHASES)})",
    )
    ap.add_argument(
        "--run-dir", type=Path, help="keep the services' logs there (default: a temp dir)"
    )
    args = ap.parse_args()
    if unknown := set(args.phases) - set(PHASES):
        ap.error(f"--phases: no phase {', '.join(sorted(unknown))} (the phases: {PHASES})")
    gc.collect()  # this client's own collections would count in the TTFTs it measures:
    gc.freeze()  # its start-up heap out of their passes, as the services do (pdserve/heap.py)
    with tempfile.TemporaryDirectory(prefix="fairbench-") as tmp:
        run = args.run_dir or Path(tmp)
        run.mkdir(parents=True, exist_ok=True)
        proc, base = up(run, args)
        try:
            t0 = time.monotonic()
            asyncio.run(ready(base, proc))
            print(f"pdserve up ready in {time.monotonic() - t0:.0f} s", flush=True)
            print(json.dumps(asyncio.run(phases(base, args)), indent=2))
        finally:
            proc.send_signal(signal.SIGTERM)  # up stops its services in reverse order
            proc.wait(timeout=120)


if __name__ == "__main__":
    main()
