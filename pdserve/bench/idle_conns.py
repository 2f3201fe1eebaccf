"""``pdserve bench idle-conns``: does a flood of idle connections keep a real client waiting?

Opens ``--conns`` TCP connections to ``--target`` that never make a request, from one source
address (127.0.0.2) or spread over ``--sources M`` (127.0.0.2 .. 127.0.0.(M+1): all of 127/8
reaches loopback), and holds them for ``--hold-s``. What each sends (``--send``): nothing, a
partial HTTP/2 preface, a whole preface and SETTINGS (an HTTP/2 connection that never calls),
or a partial HTTP/1.1 request head; ``--tls`` completes a TLS handshake first (with
``--flood-cert``/``--flood-key``, or with no client certificate: a mutual-TLS server then
refuses it). With ``--reopen`` each connection the server closes is opened again, so the
pressure stays. Meanwhile a real client makes one call every ``--probe-every-s`` on a new
connection from 127.0.0.1 (``--probe grpc``: grpc.health.v1 Check, mutual TLS with the
``PDSERVE_TLS_*`` files unless ``--plaintext``; ``--probe http``: GET ``--http-path``
(``/v1/models``) with the API key of ``--api-key-file``). It prints the probe latencies (percentiles and max) without a
flood (``--baseline-s``) and during it, and every second how many flood connections the
server kept open (and, with ``--server-pid``, the server's open file descriptors).

    pdserve bench idle-conns --target 127.0.0.1:50051 --conns 2000 --sources 200 --plaintext
    pdserve bench idle-conns --target 127.0.0.1:8000 --probe http --api-key-file run/api_key
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import ssl
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

#: What a flood connection sends after connecting (and its TLS handshake, with --tls).
PAYLOADS = {
    "none": b"",
    # HTTP/2's client preface is 24 bytes; the last two never come
    "h2-partial": b"PRI * HTTP/2.0\r\n\r\nSM\r\n",
    # the whole preface and an empty SETTINGS frame: an HTTP/2 connection that never calls
    "h2-settings": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]),
    # a request head without its blank line (slowloris)
    "http-partial": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Wait: ",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HOST:PORT the flood and the probe dial")
    p.add_argument("--conns", type=int, default=2000, help="idle connections (default: 2000)")
    p.add_argument(
        "--sources",
        type=int,
        default=1,
        help="source addresses the flood spreads over, 127.0.0.2 on (default: 1)",
    )
    p.add_argument("--send", choices=sorted(PAYLOADS), default="none", help="see above")
    p.add_argument("--tls", action="store_true", help="flood connections handshake TLS first")
    p.add_argument("--flood-cert", default="", help="client certificate (PEM) the flood presents")
    p.add_argument("--flood-key", default="", help="its key")
    p.add_argument(
        "--reopen", action="store_true", help="open again each connection the server closes"
    )
    p.add_argument("--baseline-s", type=float, default=3.0, help="probes before the flood")
    p.add_argument("--hold-s", type=float, default=15.0, help="how long the flood is held")
    p.add_argument("--probe", choices=("grpc", "http"), default="grpc", help="the real client")
    p.add_argument("--probe-every-s", type=float, default=0.5, help="(default: 0.5)")
    p.add_argument("--probe-timeout-s", type=float, default=10.0, help="(default: 10)")
    p.add_argument(
        "--plaintext", action="store_true", help="grpc probe without TLS (the router's API)"
    )
    p.add_argument("--api-key-file", default="", help="http/grpc probe's API key (a file)")
    p.add_argument("--http-path", default="/v1/models", help="what the http probe GETs")
    p.add_argument("--server-pid", type=int, default=0, help="sample this process's open fds")
    p.add_argument("--json", default="", help="also write the results to this file")


@dataclass
class Flood:
    """The flood's connections and what became of them."""

    host: str
    port: int
    sources: list[str]
    n: int
    payload: bytes = b""
    tls: ssl.SSLContext | None = None
    reopen: bool = False
    open: int = 0
    opened: int = 0
    closed_by_server: int = 0
    failed: int = 0
    stopping: bool = False
    writers: set = field(default_factory=set)

    async def slot(self, i: int, gate: asyncio.Semaphore) -> None:
        source = self.sources[i % len(self.sources)]
        while not self.stopping:
            try:
                async with gate:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(
                            self.host,
                            self.port,
                            local_addr=(source, 0),
                            ssl=self.tls,
                            server_hostname=self.host if self.tls else None,
                        ),
                        10.0,
                    )
                    if self.payload:
                        writer.write(self.payload)
            except (OSError, TimeoutError, ssl.SSLError):
                self.failed += 1
                if not self.reopen:
                    return
                await asyncio.sleep(0.1)
                continue
            self.open += 1
            self.opened += 1
            self.writers.add(writer)
            try:
                while await reader.read(4096):
                    pass
            except (OSError, ssl.SSLError):
                pass
            self.open -= 1
            self.writers.discard(writer)
            writer.close()
            if self.stopping:
                return
            self.closed_by_server += 1
            if not self.reopen:
                return
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.stopping = True
        for w in list(self.writers):
            w.close()


def source_addresses(m: int) -> list[str]:
    """``m`` loopback source addresses from 127.0.0.2 (127.0.0.1 is the probe's)."""
    if not 1 <= m <= 250 * 256:
        raise ValueError(f"--sources must be 1 to {250 * 256}, got {m}")
    return [f"127.0.{(k + 2) // 256}.{(k + 2) % 256}" for k in range(m)]


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of ``values`` (seconds), 0 each when there are none."""
    if not values:
        return {"n": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(values),
        "p50": statistics.median(ordered),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def raise_nofile(needed: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE to at least ``needed`` (up to the hard limit);
    returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Probe:
    """The real client: one call on a new connection each time."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.key = Path(args.api_key_file).read_text().strip() if args.api_key_file else ""

    async def once(self) -> None:
        if self.args.probe == "http":
            await self._http()
        else:
            await self._grpc()

    async def _grpc(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve import identity

        # a channel of its own (not gRPC's shared subchannel pool): a new connection each time
        options = [("grpc.use_local_subchannel_pool", 1)]
        files = None if self.args.plaintext else identity.tls()
        if files is None:
            ch = grpc.aio.insecure_channel(self.args.target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(files.ca, files.key, files.cert)
            ch = grpc.aio.secure_channel(self.args.target, creds, options=options)
        metadata = (("authorization", f"Bearer {self.key}"),) if self.key else None
        async with ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(),
                timeout=self.args.probe_timeout_s,
                metadata=metadata,
                wait_for_ready=True,
            )
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"health {resp.status}")

    async def _http(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(local_addr=("127.0.0.1", 0), force_close=True)
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        timeout = aiohttp.ClientTimeout(total=self.args.probe_timeout_s)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
            http.get(f"http://{self.args.target}{self.args.http_path}", headers=headers) as resp,
        ):
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")


#: The flood's counters in the array it shares with the probing process.
COUNTERS = ("open", "opened", "closed_by_server", "failed")


def _flood_process(cfg: dict, counts, ready, go, stop) -> None:
    """The flood, in a process of its own (spawned): its event loop's work does not delay the
    probe's calls. Opens its connections once ``go`` is set, holds them until ``stop`` is,
    publishing :data:`COUNTERS` into ``counts`` every 0.1 s."""
    raise_nofile(cfg["conns"] + 256)
    asyncio.run(_flood_main(cfg, counts, ready, go, stop))


async def _flood_main(cfg: dict, counts, ready, go, stop) -> None:
    tls = None
    if cfg["tls"]:
        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
        if cfg["flood_cert"]:
            tls.load_cert_chain(cfg["flood_cert"], cfg["flood_key"] or None)
    host, _, port = cfg["target"].rpartition(":")
    flood = Flood(
        host, int(port), source_addresses(cfg["sources"]), cfg["conns"], PAYLOADS[cfg["send"]],
        tls, cfg["reopen"],
    )  # fmt: skip

    def publish() -> None:
        counts[:] = [getattr(flood, name) for name in COUNTERS]

    ready.set()
    while not go.is_set():
        await asyncio.sleep(0.02)
    gate = asyncio.Semaphore(256)  # connects in flight at once
    slots = [asyncio.create_task(flood.slot(i, gate)) for i in range(flood.n)]
    while not stop.is_set():
        publish()
        await asyncio.sleep(0.1)
    publish()
    flood.stop()
    for task in slots:
        task.cancel()
    await asyncio.gather(*slots, return_exceptions=True)


async def _main(args: argparse.Namespace) -> dict:
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    counts = mp.Array("q", len(COUNTERS), lock=False)
    ready, go, stop = mp.Event(), mp.Event(), mp.Event()
    cfg = {
        k: getattr(args, k)
        for k in ("target", "conns", "sources", "send", "tls", "flood_cert", "flood_key", "reopen")
    }
    proc = mp.Process(target=_flood_process, args=(cfg, counts, ready, go, stop), daemon=True)
    proc.start()
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise RuntimeError("the flood process did not start")
        return await _measure(args, counts, go)
    finally:
        stop.set()
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()


async def _measure(args: argparse.Namespace, counts, go) -> dict:
    probe = Probe(args)
    lat: dict[str, list[float]] = {"baseline": [], "flood": []}
    errors: dict[str, list[str]] = {"baseline": [], "flood": []}
    phase = "baseline"
    done = asyncio.Event()
    t0 = time.monotonic()
    timeline: list[dict] = []
    calls: list[tuple[float, float]] = []  # (start, seconds) of each probe, -1 = failed

    async def probing() -> None:
        while not done.is_set():
            start = time.monotonic()
            which = phase
            try:
                await probe.once()
                lat[which].append(time.monotonic() - start)
                calls.append((round(start - t0, 2), round(time.monotonic() - start, 4)))
            except Exception as exc:  # a failed call is a result
                errors[which].append(f"{type(exc).__name__}: {str(exc)[:120]}")
                calls.append((round(start - t0, 2), -1.0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), max(0.0, args.probe_every_s))

    async def sampling() -> None:
        while not done.is_set():
            row = {
                "t": round(time.monotonic() - t0, 1),
                "phase": phase,
            } | dict(zip(COUNTERS, counts[:], strict=True))
            if args.server_pid:
                row["server_fds"] = _fds(args.server_pid)
            timeline.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)

    tasks = [asyncio.create_task(probing()), asyncio.create_task(sampling())]
    await asyncio.sleep(args.baseline_s)
    phase = "flood"
    go.set()
    await asyncio.sleep(args.hold_s)
    done.set()
    await asyncio.gather(*tasks)
    flood = dict(zip(COUNTERS, counts[:], strict=True))
    held = [r["open"] for r in timeline if r["phase"] == "flood"]
    return {
        "target": args.target,
        "conns": args.conns,
        "sources": args.sources,
        "send": args.send,
        "tls": args.tls,
        "reopen": args.reopen,
        "probe": args.probe,
        "baseline": percentiles(lat["baseline"]) | {"errors": len(errors["baseline"])},
        "flood": percentiles(lat["flood"]) | {"errors": len(errors["flood"])},
        "flood_open_max": max(held, default=0),
        "flood_opened": flood["opened"],
        "flood_closed_by_server": flood["closed_by_server"],
        "flood_failed": flood["failed"],
        "errors": errors["baseline"][:5] + errors["flood"][:5],
        "timeline": timeline,
        "probes": calls,
    }


def report(result: dict) -> str:
    """The human-readable summary of a run."""

    def ms(s: float) -> str:
        return f"{s * 1000:.0f} ms"

    lines = [
        f"idle-conns {result['target']}: {result['conns']} connections from "
        f"{result['sources']} address(es), send={result['send']} tls={result['tls']} "
        f"reopen={result['reopen']}, probe={result['probe']}"
    ]
    for phase in ("baseline", "flood"):
        p = result[phase]
        lines.append(
            f"  {phase:8s} probes {p['n']:3d}  p50 {ms(p['p50'])}  p90 {ms(p['p90'])}  "
            f"p99 {ms(p['p99'])}  max {ms(p['max'])}  errors {p['errors']}"
        )
    lines.append(
        f"  flood: at most {result['flood_open_max']} open at once, {result['flood_opened']} "
        f"opened, {result['flood_closed_by_server']} closed by the server, "
        f"{result['flood_failed']} connects failed"
    )
    lines.extend(f"  error: {e}" for e in result["errors"])
    slow = [
        f"{t:.1f}s: " + (f"{s * 1000:.0f} ms" if s >= 0 else "failed")
        for t, s in result["probes"]
        if s > 0.5 or s < 0
    ]
    if slow:
        lines.append("  probes over 500 ms or failed (start: latency): " + ", ".join(slow))
    lines.append("  t(s)  phase     open  closed_by_server  failed" + ("  server_fds" * bool(
        result["timeline"] and "server_fds" in result["timeline"][0])))  # fmt: skip
    for r in result["timeline"]:
        extra = f"  {r['server_fds']:10d}" if "server_fds" in r else ""
        lines.append(
            f"  {r['t']:5.1f} {r['phase']:8s} {r['open']:5d}  {r['closed_by_server']:16d}  "
            f"{r['failed']:6d}{extra}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    got = raise_nofile(args.conns + 256)
    if got < args.conns + 64:
        print(f"file-descriptor limit {got} is too low for {args.conns} connections")
        return 2
    result = asyncio.run(_main(args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
