"""``pdserve bench soak``: does anything grow or leak under steady load?

Starts a supervised cluster as ``pdserve up`` does and keeps mixed load on it for
``--minutes``: completions through the router (prompts that share prefixes, so chunks are
read back from the store, and fresh ones, so new chunks are stored), plus a store client
putting, reading and removing 1 MiB objects. Every ``--sample-s`` it samples each service's
RSS, open file descriptors and threads, and the /dev/shm segments. A service passes when its
RSS grew less than ``--max-growth`` (5 %) from the end of the warm-up to the end, and its
descriptors and the segments did not grow.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.chaos import BenchCluster, Load, add_cluster_arguments, prompts


@dataclass
class Sample:
    t: float
    rss: dict[str, int]
    fds: dict[str, int]
    threads: dict[str, int]
    shm: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the run (default: 10)")
    p.add_argument(
        "--warmup-minutes",
        type=float,
        default=1.0,
        help="first minutes not judged: caches, pools and allocators fill (default: 1)",
    )
    p.add_argument("--sample-s", type=float, default=10.0, help="sampling period (default: 10)")
    p.add_argument(
        "--max-growth", type=float, default=0.05, help="RSS growth allowed (default: 0.05)"
    )


def _proc(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open fds, threads) of ``pid``; zeros when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return 0, 0, 0


def _store_load(address: str, stop: threading.Event, counts: dict[str, int]) -> None:
    from pdserve.store import open_store

    data = os.urandom(1 << 20)
    with open_store(address, timeout_s=10) as client:
        i = 0
        while not stop.is_set():
            keys = [f"soak-{i}-{j}" for j in range(8)]
            client.batch_put([(k, data) for k in keys])
            got = client.batch_get(keys)
            counts["store_ops"] += 1
            counts["store_bad"] += sum(g != data for g in got)
            client.release_leases()
            client.remove(keys)
            i += 1
            time.sleep(0.05)


class Soak(BenchCluster):
    def sample(self, t0: float) -> Sample:
        rss, fds, threads = {}, {}, {}
        for p in list(self.cluster.procs):
            rss[p.name], fds[p.name], threads[p.name] = _proc(p.pid)
        shm = sum(1 for f in os.listdir("/dev/shm") if f.startswith("pdserve"))
        return Sample(round(time.monotonic() - t0, 1), rss, fds, threads, shm)

    def run(self) -> dict:
        self.start()
        words = "soak test prompt with shared prefixes and fresh tails for the store"
        base = prompts(2, 24, words)
        load = Load(self.cfg.http_port, self.cfg.model, base, self.args.timeout_s, self.key)
        load.fresh_every = 4
        stop = threading.Event()
        counts = {"store_ops": 0, "store_bad": 0}
        store = threading.Thread(
            target=_store_load, args=(f"127.0.0.1:{self.cfg.master_port}", stop, counts)
        )
        samples: list[Sample] = []
        t0 = time.monotonic()
        outcomes = []
        try:
            load.start(self.args.clients)
            store.start()
            end = t0 + self.args.minutes * 60
            while time.monotonic() < end:
                samples.append(self.sample(t0))
                print(json.dumps(asdict(samples[-1])), flush=True)
                time.sleep(min(self.args.sample_s, max(0.0, end - time.monotonic())))
            samples.append(self.sample(t0))
        finally:
            stop.set()
            outcomes = load.stop()
            store.join()
            self.stop()
        return self.judge(samples, outcomes, counts)

    def judge(self, samples: list[Sample], outcomes: list, counts: dict[str, int]) -> dict:
        warm = next(
            (s for s in samples if s.t >= self.args.warmup_minutes * 60), samples[len(samples) // 2]
        )
        last = samples[-1]
        rows = []
        for name in last.rss:
            start, end = warm.rss.get(name, 0), last.rss[name]
            growth = (end - start) / start if start else 0.0
            restarted = self.cluster.supervised[name].restarts > 0
            ok = (
                growth < self.args.max_growth
                and last.fds[name] <= warm.fds.get(name, 0)
                and not restarted
            )
            rows.append(
                {
                    "service": name,
                    "rss_start_mib": round(start / 2**20, 1),
                    "rss_end_mib": round(end / 2**20, 1),
                    "rss_growth": round(growth, 4),
                    "fds": [warm.fds.get(name, 0), last.fds[name]],
                    "threads": [warm.threads.get(name, 0), last.threads[name]],
                    "restarts": self.cluster.supervised[name].restarts,
                    "ok": ok,
                }
            )
        return {
            "minutes": self.args.minutes,
            "warmup_at_s": warm.t,
            "requests": len(outcomes),
            "requests_ok": sum(o.status == 200 for o in outcomes),
            **counts,
            "shm_segments": [warm.shm, last.shm],
            "services": rows,
            "pass": all(r["ok"] for r in rows) and last.shm <= warm.shm and not counts["store_bad"],
        }


def render(report: dict) -> str:
    lines = [
        f"{report['minutes']:g}-minute soak: {report['requests_ok']}/{report['requests']} "
        f"requests ok, {report['store_ops']} store batches (8 x 1 MiB put, get, remove), "
        f"{report['store_bad']} bad reads; /dev/shm segments {report['shm_segments'][0]} -> "
        f"{report['shm_segments'][1]}; judged from t={report['warmup_at_s']:.0f}s",
        f"{'service':<16} {'RSS MiB':>15} {'growth':>7} {'fds':>9} {'threads':>9} {'restarts':>8}",
    ]
    for r in report["services"]:
        lines.append(
            f"{r['service']:<16} {r['rss_start_mib']:>6.1f} -> {r['rss_end_mib']:>6.1f} "
            f"{100 * r['rss_growth']:>6.1f}% {r['fds'][0]:>4}->{r['fds'][1]:<4} "
            f"{r['threads'][0]:>4}->{r['threads'][1]:<4} {r['restarts']:>8}"
            + ("" if r["ok"] else "  GROWS")
        )
    lines.append("PASS" if report["pass"] else "FAIL")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = Soak(args).run()
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1
