"""Idle connections against real `pdserve up` processes (issue 56): while 1,100 idle TCP
connections are held on a port (more than the 1,024 file descriptors a service started with
before it raised its limit), from one address and from 100, the router (gRPC and HTTP), the KV
store master and a storage node serve a real client on a new connection; on the router's HTTP
port one address holds at most its per-address cap and the rest are answered 429. And 10 wrong
API keys from an address do not refuse the right key from it, over HTTP and gRPC.

No timing is asserted (the figures are `pdserve bench idle-conns`'s, docs/benchmarks.md): the
checks are that the call is answered and that the flood was still held when it was."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from up_harness import services_of, start_up, stop_up

from pdserve.bench.idle_conns import Flood, raise_nofile, source_addresses
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

#: Idle connections per flood: past the 1,024 descriptors a process has by default.
N = 1100
#: The router's HTTP connections per address (the test's config; default 128).
PER_PEER = 64
#: Long enough that no flood connection is closed by a deadline during a check.
HOLD_S = 300
#: Descriptors a server may close for reasons of its own while a flood is counted.
SLACK = 32
DEADLINE_S = 120


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _until(what: str, condition, state=lambda: "") -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE_S} s: {what} ({state()})")
        await asyncio.sleep(0.05)


class Cluster:
    """What the checks dial: ports, pids, the key and up's admin certificate."""

    def __init__(self, banner: str, ports: dict[str, int], run_dir: Path) -> None:
        self.key = (run_dir / "api_key").read_text().strip()
        self.http = ports["http"]
        self.router = int(re.search(r"RouterService\)\s+127\.0\.0\.1:(\d+)", banner).group(1))
        self.master = ports["master"]
        node_log = (run_dir / "logs" / "kvstore-node-0.log").read_text()
        ready = next(ln for ln in node_log.splitlines() if ln.startswith("PDSERVE_READY"))
        self.node = json.loads(ready.split(" ", 1)[1])["port"]
        svc = services_of(run_dir)
        self.pids = {
            "router": svc["router"]["pid"],
            "master": svc["kvstore-master"]["pid"],
            "node": svc["kvstore-node-0"]["pid"],
        }
        certs = run_dir / "certs"
        self.creds = grpc.ssl_channel_credentials(
            (certs / "ca.crt").read_bytes(),
            (certs / "admin.key").read_bytes(),
            (certs / "admin.crt").read_bytes(),
        )

    def bearer(self, key: str = "") -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {key or self.key}"),)

    async def generate(self, key: str = "") -> router_pb2.GenerateResponse:
        """A Generate of 2 tokens on a new connection to the router's gRPC port."""
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.router}", options=options) as ch:
            req = router_pb2.GenerateRequest(
                model="tiny", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(
                    max_tokens=2, temperature=0
                )
            )  # fmt: skip
            return await router_pb2_grpc.RouterServiceStub(ch).Generate(
                req, timeout=DEADLINE_S, metadata=self.bearer(key)
            )

    async def complete(self, key: str = "") -> tuple[int, dict]:
        """A completion on a new connection to the router's HTTP port, from 127.0.0.1."""
        body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.1", 0), force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.post(
                f"http://127.0.0.1:{self.http}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key or self.key}"},
                timeout=aiohttp.ClientTimeout(total=DEADLINE_S),
            ) as resp,
        ):
            return resp.status, await resp.json()

    async def health(self, port: int) -> int:
        """grpc.health Check on a new mutual-TLS connection (up's admin certificate)."""
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", self.creds, options) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=DEADLINE_S
            )
        return resp.status


def _counts(flood: Flood) -> dict[str, int]:
    names = ("open", "opened", "closed_by_server", "failed")
    return {name: getattr(flood, name) for name in names}


async def _flooded(port: int, pid: int, sources: int, served, *, held: int = N) -> None:
    """Holds N idle connections to ``port`` from ``sources`` addresses; once the server
    (``pid``) has accepted ``held`` of them (the rest closed by it), awaits ``served()`` and
    checks that the server still held every one of them when it was answered."""
    # the server's descriptors before, less a few it may close meanwhile (a start-up call's)
    base = _fds(pid) - SLACK
    flood = Flood("127.0.0.1", port, source_addresses(sources), N)
    gate = asyncio.Semaphore(256)
    slots = [asyncio.create_task(flood.slot(i, gate)) for i in range(N)]
    try:
        await _until(
            f"{held} of {N} connections to :{port} held",
            lambda: (
                flood.opened + flood.failed == N
                and flood.open == held
                and flood.closed_by_server == N - held
                and _fds(pid) >= base + held
            ),
            lambda: f"flood: {_counts(flood)}, server descriptors {_fds(pid)}, base {base}",
        )
        await served()
        assert flood.open == held and flood.closed_by_server == N - held, _counts(flood)
    finally:
        flood.stop()
        for task in slots:
            task.cancel()
        await asyncio.gather(*slots, return_exceptions=True)
    await _until(
        f"the server at :{port} closed the flood",
        lambda: _fds(pid) < base + held,
        lambda: f"server descriptors {_fds(pid)}, base {base}",
    )


@pytest.mark.slow
def test_idle_connections_do_not_keep_a_real_client_waiting(tmp_path: Path):
    raise_nofile(N + 512)
    config = tmp_path / "cluster.yaml"
    deadline = f"  grpc_handshake_timeout_s: {HOLD_S}\n"
    config.write_text(
        f"router:\n{deadline}  http_header_timeout_s: {HOLD_S}\n"
        f"  http_max_conns_per_peer: {PER_PEER}\n"
        f"kvstore_master:\n{deadline}kvstore_node:\n{deadline}"
    )
    proc, banner, ports, run_dir = start_up(
        tmp_path, "--engine", "torch", "--model", "tiny", "--decode-workers", "1",
        "--segment-size", "64MiB", "--config", str(config),
    )  # fmt: skip
    try:
        c = Cluster(banner, ports, run_dir)

        async def generated() -> None:
            assert (await c.generate()).token_ids

        async def completed() -> None:
            status, body = await c.complete()
            assert status == 200 and body["choices"][0]["text"] is not None, body

        async def master_serves() -> None:
            assert await c.health(c.master) == health_pb2.HealthCheckResponse.SERVING

        async def node_serves() -> None:
            assert await c.health(c.node) == health_pb2.HealthCheckResponse.SERVING

        async def main() -> None:
            for sources in (1, 100):
                await _flooded(c.router, c.pids["router"], sources, generated)
                await _flooded(c.master, c.pids["master"], sources, master_serves)
                await _flooded(c.node, c.pids["node"], sources, node_serves)
            # HTTP: one address holds its PER_PEER, the rest answered 429 and closed
            await _flooded(c.http, c.pids["router"], 1, completed, held=PER_PEER)
            # 100 addresses (11 each) are under the per-address cap: every one held
            await _flooded(c.http, c.pids["router"], 100, completed)

            # 10 wrong keys from 127.0.0.1 on each API (the budget, 10, is shared: the later
            # ones are answered 429 / RESOURCE_EXHAUSTED), then the right key is served
            for _ in range(10):
                status, _body = await c.complete("wrong-key")
                assert status in (401, 429)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await c.generate("wrong-key")
                assert exc.value.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            assert (await c.complete("wrong-key"))[0] == 429  # the budget is spent
            await completed()
            await generated()

        asyncio.run(main())
    finally:
        stop_up(proc)
