"""``pdserve bench chaos``: faults under load, counted.

Starts a whole cluster as ``pdserve up`` does (supervised: a killed service is restarted),
sends steady load through the router's OpenAI API (greedy, so every answer has one right
text, learned before any fault), and then, one at a time, SIGKILLs a storage node, a prefill
worker, a decode worker, the KV store master and meta, stops the master for ``--stall-s``
seconds (SIGSTOP; with ``--kvstore-masters 2`` or more, both hit the master leading then), and
runs a late writer (a put that stalls past the master's put timeout, then writes over the
region the master has since handed to someone else). Per fault it counts the requests that
completed token-exact, completed wrong (must be 0), failed with a retriable status, failed
otherwise, or hung (no answer within the timeout, must be 0); the router's retries; marker
objects put in the store before the fault and missing after (must be 0: a killed store
process costs cache hits, never data it comes back with); the time from the fault until
every request succeeds again (``recovery``), until prompts are served from the store again
(``store``: every answer loads part of its prompt from it) and, for a killed service, until
``up`` has it restarted and ready (``restart``; :mod:`pdserve.bench.chaos_recovery`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench import chaos_recovery as recovery

MARKERS = 32
MARKER_BYTES = 256 * 1024


@dataclass
class Outcome:
    start: float
    end: float
    prompt: int
    status: int  # HTTP status; 0 = no answer within the timeout
    text: str = ""
    #: prompt tokens the answer says were cached (usage.prompt_tokens_details.cached_tokens)
    cached: int = 0


@dataclass
class FaultRow:
    fault: str
    requests: int = 0
    exact: int = 0
    wrong: int = 0
    retriable: int = 0
    failed: int = 0
    hung: int = 0
    retries: float = 0
    markers_lost: int = 0
    corrupt_chunks_detected: float = 0
    recovery_s: float | None = None
    store_s: float | None = None
    restart_s: float | None = None
    #: wall-clock time of the fault (to find it in the services' logs)
    at: float = 0.0
    notes: list[str] = field(default_factory=list)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster and load flags ``bench chaos`` and ``bench soak`` share."""
    p.add_argument("--engine", default="torch", help="worker engine (default: torch)")
    p.add_argument(
        "--model", default="tiny", help="model (default: tiny: faults, not speed, are measured)"
    )
    p.add_argument("--chunk-size", type=int, default=16, help="KV chunk tokens (default: 16)")
    p.add_argument("--prefill-workers", type=int, default=1, help="(default: 1)")
    p.add_argument("--decode-workers", type=int, default=1, help="(default: 1)")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients (default: 2)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="a request with no answer after this long is hung (default: 60)",
    )
    p.add_argument("--run-dir", default="", help="cluster logs and state (default: a temp dir)")
    p.add_argument("--json", default="", help="also write the results as JSON here")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    p.add_argument(
        "--phase-s", type=float, default=15.0, help="load after each fault, seconds (default: 15)"
    )
    p.add_argument(
        "--faults",
        default="node,prefill,decode,master,meta,stall,late-writer",
        help="faults to run, in order (default: %(default)s)",
    )
    p.add_argument(
        "--kvstore-masters",
        type=int,
        default=1,
        help="KV store masters (2+: elected through an etcd up runs; master and stall then hit "
        "the leader) (default: 1)",
    )
    p.add_argument(
        "--stall-s", type=float, default=3.0, help="how long stall stops the master (default: 3)"
    )


class Load:
    """Client threads sending the prompts round robin (with the router's API key ``key``);
    every outcome is recorded."""

    def __init__(
        self, http: int, model: str, prompts: list[str], timeout_s: float, key: str = ""
    ) -> None:
        from pdserve.bench.serve.http import auth_headers

        self.url = f"http://127.0.0.1:{http}/v1/completions"
        self.headers = {"Content-Type": "application/json", **auth_headers(key)}
        self.model = model
        self.prompts = prompts
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = 0
        self._threads: list[threading.Thread] = []
        #: every n-th request of a client is a prompt from a larger rotating set (new chunks
        #: for the store until the set has gone round; not scored; 0 = none)
        self.fresh_every = 0

    def add(self, prompts: list[str], refs: list[str]) -> None:
        """More prompts with their right answers (``refs`` is the list the scoring reads)."""
        with self._lock:
            refs.extend(self.ask_text(p).text for p in prompts)
            self.prompts.extend(prompts)

    def ask(self, i: int) -> Outcome:
        out = self.ask_text(self.prompts[i])
        out.prompt = i
        return out

    def ask_text(self, prompt: str) -> Outcome:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(self.url, json.dumps(body).encode(), self.headers)
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
                text = body["choices"][0]["text"]
                usage = body.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                return Outcome(t0, time.monotonic(), -1, resp.status, text, int(cached))
        except urllib.error.HTTPError as exc:
            return Outcome(t0, time.monotonic(), -1, exc.code)
        except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
            timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc)
            return Outcome(t0, time.monotonic(), -1, 0 if timed_out else 503)

    def _client(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            if self.fresh_every and n % self.fresh_every == 0:  # other chunks for the store
                out = self.ask_text(f"{n % 64} {self.prompts[(n // 64) % len(self.prompts)]}")
                with self._lock:
                    self.outcomes.append(out)
                continue
            with self._lock:
                i, self._next = self._next, (self._next + 1) % len(self.prompts)
            out = self.ask(i)
            if out.status == 503:
                time.sleep(0.05)  # connection refused: do not spin
            with self._lock:
                self.outcomes.append(out)

    def start(self, clients: int) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join()
        with self._lock:
            out, self.outcomes = self.outcomes, []
        return out


def _metric(address: str, name: str) -> float:
    """Sum of a counter over its labels, from the /metrics at ``address`` (0 if it is down)."""
    from pdserve.bench.serve.http import scrape

    samples = scrape(f"http://{address}") or {}
    return sum(v for (n, _labels), v in samples.items() if n == name)


def prompts(seed: int, n: int, words: str, shared: int = 3) -> list[str]:
    """``n`` prompts of ``words``, in ``shared`` groups with a common prefix (store hits)."""
    rng = random.Random(seed)
    vocab = words.split()
    heads = [" ".join(rng.choices(vocab, k=40)) for _ in range(shared)]
    return [f"{heads[i % shared]} {' '.join(rng.choices(vocab, k=8))}" for i in range(n)]


class BenchCluster:
    """A supervised ``pdserve up`` cluster on free ports for the fault and soak benchmarks,
    with ``up``'s defaults: mutual TLS between the services (this process dials them as the
    run dir's admin identity once :meth:`start` returns) and an API key on the router."""

    def __init__(self, args: argparse.Namespace, config_yaml: str = "") -> None:
        from pdserve.commands.up import UpConfig
        from pdserve.commands.up_cluster import Cluster
        from pdserve.procs import free_ports

        self.args = args
        self.run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
        meta, meta_http, router, http = free_ports(4)
        masters = getattr(args, "kvstore_masters", 1)
        master, etcd = recovery.port_runs((masters, 2), avoid={meta, meta_http, router, http})
        cfg = UpConfig(
            engine=args.engine,
            model=args.model,
            chunk_size=args.chunk_size,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
            segment_size="256MiB",
            meta_port=meta,
            meta_http_port=meta_http,
            master_port=master,
            router_port=router,
            http_port=http,
            run_dir=str(self.run_dir),
            kvstore_masters=masters,
            etcd_port=etcd,
        )
        cfg.validate()
        cfg.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        conf = None
        if config_yaml:
            conf = self.run_dir / "bench.yaml"
            conf.write_text(config_yaml)
        self.cluster = Cluster(cfg, str(conf) if conf else None)
        self.cfg = cfg
        self._supervising = threading.Event()

    @property
    def key(self) -> str:
        """The router's API key (``up`` generates one unless the config turns auth off)."""
        return self.cfg.api_key

    def _router_metric(self, name: str) -> float:
        return _metric(f"127.0.0.1:{self.cfg.http_port}", name)

    def _worker_metric(self, name: str) -> float:
        """Summed over the workers (a restarted one starts from 0 again)."""
        return sum(
            _metric(p.info["metrics"], name)
            for p in list(self.cluster.procs)
            if p.name.startswith(("prefill", "decode")) and p.info.get("metrics")
        )

    @property
    def masters(self) -> dict[str, str]:
        """Each KV store master's service name and address."""
        from pdserve.commands import up_etcd

        return up_etcd.masters(self.cfg)

    def pid(self, name: str) -> int:
        return next(p.pid for p in self.cluster.procs if p.name == name)

    def _supervise(self) -> None:
        from pdserve.commands.up_cluster import SUPERVISE_S

        while not self._supervising.is_set():  # at up's own pace (the restart times are up's)
            self.cluster.supervise_once()
            time.sleep(SUPERVISE_S)

    def start(self) -> None:
        try:
            self.cluster.start()
        except BaseException:
            self.cluster.stop()
            raise
        threading.Thread(target=self._supervise, daemon=True).start()

    def stop(self) -> None:
        self._supervising.set()
        self.cluster.stop()


class Chaos(BenchCluster):
    def __init__(self, args: argparse.Namespace) -> None:
        # A short put timeout, so the late writer's region is handed out again within the run.
        super().__init__(args, "kvstore_master:\n  put_timeout_s: 1.0\n")

    def run(self) -> list[FaultRow]:

        self.start()
        try:
            return self._run()
        finally:
            self.stop()

    def _run(self) -> list[FaultRow]:
        from pdserve.store import open_store

        words = "the of a KV cache store chunk node master router token prefill decode"
        texts = prompts(0, 12, words)
        load = Load(self.cfg.http_port, self.cfg.model, texts, self.args.timeout_s, self.key)
        first = [load.ask(i) for i in range(len(texts))]
        if any(r.status != 200 for r in first):
            raise RuntimeError(f"warm-up failed: {[r.status for r in first]}")
        refs = [r.text for r in first]
        if [load.ask(i).text for i in range(len(texts))] != refs:
            raise RuntimeError("greedy answers are not repeatable: cannot tell wrong from right")
        rows = []
        with open_store(",".join(self.masters.values()), timeout_s=10) as store:
            for n, fault in enumerate(self.args.faults.split(",")):
                rows.append(self._phase(fault.strip(), n, load, refs, store))
                print(json.dumps(asdict(rows[-1])), file=sys.stderr, flush=True)
        return rows

    def _phase(self, fault: str, n: int, load: Load, refs: list[str], store) -> FaultRow:
        row = FaultRow(fault)
        markers = [f"chaos-marker-{n}-{i}" for i in range(MARKERS)]
        recovery.retry(store.batch_put, [(k, os.urandom(MARKER_BYTES)) for k in markers])
        retries0 = self._router_metric("pdserve_router_retries_total")
        corrupt0 = self._worker_metric("pdserve_store_corrupt_chunks_total")
        load.start(self.args.clients)
        time.sleep(2.0)
        t_fault = time.monotonic()
        victim = {
            "node": "kvstore-node-0",
            "prefill": "prefill-0",
            "decode": "decode-0",
            "meta": "meta",
        }.get(fault)
        if fault in ("master", "stall"):
            victim = recovery.master_victim(self.cluster, self.masters)
            if len(self.masters) > 1:
                row.notes.append(f"{victim} led")
            t_fault = time.monotonic()
        if fault == "stall":
            recovery.pause(self.pid(victim), self.args.stall_s)
        elif victim is not None:
            if victim not in self.cluster.supervised:
                row.notes.append(f"no {victim} in this topology")
            else:
                restarts = self.cluster.supervised[victim].restarts
                os.kill(self.pid(victim), signal.SIGKILL)
                back = recovery.wait_restarted(self.cluster, victim, restarts + 1)
                row.restart_s = round(back - t_fault, 2)
        elif fault == "late-writer":
            self._late_writer(store, load, refs, row)
        else:
            raise SystemExit(f"unknown fault {fault!r}")
        time.sleep(self.args.phase_s)
        outcomes = load.stop()
        recovery.score(row, outcomes, refs, t_fault)
        row.store_s = recovery.store_served_s(outcomes, refs, t_fault)
        row.at = round(time.time() - (time.monotonic() - t_fault), 3)
        row.retries = self._router_metric("pdserve_router_retries_total") - retries0
        row.corrupt_chunks_detected = (
            self._worker_metric("pdserve_store_corrupt_chunks_total") - corrupt0
        )
        row.markers_lost = sum(not e for e in recovery.retry(store.exists, markers))
        recovery.retry(store.remove, markers)
        return row

    def _late_writer(self, store, load: Load, refs: list[str], row: FaultRow) -> None:
        """A put that stalls past the master's put timeout, then writes garbage over its
        region, again and again while fresh prompts' chunks are stored (some land there)."""
        from pdserve.v1 import kvstore_pb2 as pb

        late = []
        for i in range(8):
            resp = store.master.call(
                "BatchPutStart",
                pb.BatchPutStartRequest(
                    client_id="late-writer",
                    items=[pb.PutStartItem(key=f"chaos-late-{i}", size=1 << 20)],
                ),
            )
            late += [r.replicas[0] for r in resp.results if r.code == pb.KV_OK]
        time.sleep(2.0)  # timed out: the regions go to the next puts
        fresh = prompts(1, 6, "fresh prompt whose chunks are new to the store", shared=6)
        load.add(fresh, refs)  # computed (no store hit), then stored: some land in the regions
        garbage = os.urandom(1 << 20)
        landed = 0
        for _ in range(3):
            errs = store.routes.get("tcp").write_many([(rep, memoryview(garbage)) for rep in late])
            landed += sum(e is None for e in errs)
            time.sleep(0.5)
        # With data tokens on, the nodes refuse writes past the grant's expiry (the put
        # timeout) plus their clock skew allowance.
        row.notes.append(
            f"late writer: {landed} of {3 * len(late)} writes of 1 MiB over its regions landed"
        )


def render(rows: list[FaultRow]) -> str:
    head = (
        f"{'fault':<12} {'requests':>8} {'exact':>6} {'wrong':>6} {'retriable':>9} "
        f"{'failed':>6} {'hung':>5} {'retries':>7} {'lost':>5} {'corrupt':>7} {'recovery':>9} "
        f"{'store':>7} {'restart':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        rec, store, back = (
            "-" if s is None else f"{s:.1f}s" for s in (r.recovery_s, r.store_s, r.restart_s)
        )
        lines.append(
            f"{r.fault:<12} {r.requests:>8} {r.exact:>6} {r.wrong:>6} {r.retriable:>9} "
            f"{r.failed:>6} {r.hung:>5} {r.retries:>7.0f} {r.markers_lost:>5} "
            f"{r.corrupt_chunks_detected:>7.0f} {rec:>9} {store:>7} {back:>7}"
            + (f"  {'; '.join(r.notes)}" if r.notes else "")
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = Chaos(args).run()
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    bad = any(r.wrong or r.hung or r.markers_lost for r in rows)
    return 1 if bad else 0
