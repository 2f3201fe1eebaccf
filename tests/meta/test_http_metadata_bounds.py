"""The Mooncake HTTP metadata endpoint stays closed or authenticated whenever it is on, and
bounded whatever the address (services/meta/http_metadata.py): caps on one value (413), on the
number of keys and on the bytes of every value together (507); with a token every request,
reads too, must carry it; beyond loopback meta refuses to serve it without a token unless
explicitly opened; and it is off unless asked for."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve import config, identity
from pdserve.commands.cli import build_parser
from pdserve.config import ConfigError
from pdserve.services.meta import http_metadata
from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.server import MetaConfig


@contextlib.asynccontextmanager
async def _served(app: web.Application) -> AsyncIterator[str]:
    runner, port = await http_metadata.start(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}{http_metadata.PATH}"
    finally:
        await runner.cleanup()


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None, **headers: str
) -> tuple[int, str]:
    async with http.request(method, url, data=body, headers=headers) as resp:
        return resp.status, await resp.text()


def test_values_keys_and_total_bytes_are_capped() -> None:
    async def main() -> None:
        backend = MemoryBackend()
        app = http_metadata.make_app(
            backend, max_keys=3, max_value_bytes=1000, max_total_bytes=2000
        )
        value = b'"' + b"v" * 798 + b'"'  # 800 bytes of JSON
        async with _served(app) as url, aiohttp.ClientSession() as http:
            # one value over http_max_value_bytes: 413, with a length or chunked
            big = b'"' + b"x" * 1200 + b'"'
            code, text = await _call(http, "PUT", f"{url}?key=big", big)
            assert code == 413 and "http_max_value_bytes (1000 bytes)" in text

            async def chunks():
                yield big

            code, text = await _call(http, "PUT", f"{url}?key=big", chunks())
            assert code == 413 and "http_max_value_bytes" in text
            # the total: two of 800 fit, a third would hold 2400 bytes
            assert (await _call(http, "PUT", f"{url}?key=a", value))[0] == 200
            assert (await _call(http, "PUT", f"{url}?key=b", value))[0] == 200
            code, text = await _call(http, "PUT", f"{url}?key=c", value)
            assert code == 507 and "http_max_total_bytes (2000 bytes)" in text
            # overwriting counts the old value out: a same-size rewrite fits
            assert (await _call(http, "PUT", f"{url}?key=b", value))[0] == 200
            # deleting frees its bytes
            assert (await _call(http, "DELETE", f"{url}?key=b"))[0] == 200
            assert (await _call(http, "PUT", f"{url}?key=c", value))[0] == 200
            # the number of keys: small values, the key cap answers
            assert (await _call(http, "PUT", f"{url}?key=d", b"1"))[0] == 200
            code, text = await _call(http, "PUT", f"{url}?key=e", b"1")
            assert code == 507 and "http_max_keys (3)" in text
            assert await backend.kv_count() == 3
            assert await backend.kv_bytes() == 1601
            # 300 PUTs of 1 MiB (the probe) now stop at the caps, not at meta's memory
            app2 = http_metadata.make_app(MemoryBackend())  # the defaults
            async with _served(app2) as url2:
                mib = b'"' + b"m" * (http_metadata.MAX_VALUE_BYTES - 2) + b'"'
                codes = [(await _call(http, "PUT", f"{url2}?key=p{i}", mib))[0] for i in range(80)]
                fit = http_metadata.MAX_TOTAL_BYTES // len(mib)
                assert codes == [200] * fit + [507] * (80 - fit)

    asyncio.run(main())


def test_with_a_token_every_request_reads_included_must_carry_it() -> None:
    async def main() -> None:
        app = http_metadata.make_app(MemoryBackend(), token="tok-5e1d")
        basic = "Basic " + base64.b64encode(b"pdserve:tok-5e1d").decode()
        async with _served(app) as url, aiohttp.ClientSession() as http:
            for method, body in (("PUT", b"{}"), ("GET", None), ("DELETE", None)):
                code, text = await _call(http, method, f"{url}?key=k", body)
                assert code == 401 and "http_token" in text, method
                code, _ = await _call(
                    http, method, f"{url}?key=k", body, Authorization="Bearer nope"
                )
                assert code == 401, method
            ok = {"Authorization": "Bearer tok-5e1d"}
            assert (await _call(http, "PUT", f"{url}?key=k", b"{}", **ok))[0] == 200
            assert await _call(http, "GET", f"{url}?key=k", Authorization=basic) == (200, "{}")
            assert (await _call(http, "DELETE", f"{url}?key=k", **ok))[0] == 200

    asyncio.run(main())


def _meta(**fields: object) -> MetaConfig:
    return config.load(MetaConfig, "meta", env={}, overrides=fields)


def test_beyond_loopback_the_endpoint_needs_a_token_or_an_explicit_opening() -> None:
    # off by default: nothing to check, whatever the address
    assert not _meta(host="0.0.0.0").http_metadata
    # on loopback: closed to other hosts
    _meta(host="127.0.0.1", http_metadata=True)
    _meta(host="::1", http_metadata=True)
    with pytest.raises(ConfigError) as err:
        _meta(host="0.0.0.0", http_metadata=True, tls_cert="c.crt")
    msg = str(err.value)
    assert "would listen on '0.0.0.0', reachable from other hosts, without http_token" in msg
    assert "--http-metadata-open" in msg and "Bind 127.0.0.1" in msg
    with pytest.raises(ConfigError):
        _meta(host="10.1.2.3", http_metadata=True)
    # the ways out: a token, the explicit opening, the port off, a plaintext --insecure cluster
    _meta(host="10.1.2.3", http_metadata=True, http_token="t")
    _meta(host="10.1.2.3", http_metadata=True, http_metadata_open=True)
    _meta(host="10.1.2.3", http_metadata=True, http_port=-1)
    _meta(host="10.1.2.3", http_metadata=True, insecure=True)
    with pytest.raises(ConfigError):  # --insecure does not open it on a TLS cluster
        _meta(host="10.1.2.3", http_metadata=True, insecure=True, tls_cert="c.crt")
    with pytest.raises(ConfigError, match="http_max_total_bytes must be positive"):
        _meta(http_max_total_bytes=0)


def test_pdserve_meta_refuses_to_start_with_an_open_endpoint_beyond_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["meta", "--host", "0.0.0.0", "--http-metadata"])
    prior = identity.tls()
    try:
        assert args.func(args) == 2  # a config error, before anything listens
    finally:
        identity.configure_files(prior)
    err = capsys.readouterr().err
    assert "pdserve meta:" in err and "without http_token" in err


def test_up_serves_the_endpoint_only_for_mooncake_engines_that_use_it(tmp_path) -> None:
    """``pdserve up`` starts meta with --http-metadata only for --store-backend mooncake
    --store-metadata-server meta; otherwise meta's HTTP port serves Prometheus discovery."""
    from pdserve.commands.up import UpConfig
    from pdserve.commands.up_cluster import Cluster

    def meta_args(**fields: object) -> list[str]:
        cfg = UpConfig(run_dir=str(tmp_path), tls=False, **fields)
        cfg.resolve(gpus=[])
        cluster = Cluster(cfg, None, places=[None] * len(cfg.workers()))
        got: list[list[str]] = []

        def start(specs, *_):
            got.extend(args for name, args in specs if name == "meta")
            raise _Stop

        cluster._start = start
        cluster._secure = lambda _ids: None
        with contextlib.suppress(_Stop), contextlib.redirect_stderr(io.StringIO()):
            cluster.start()
        return got[0]

    assert not any("http-metadata" in a for a in meta_args())
    mooncake = dict(store_backend="mooncake", store_metadata_server="meta")
    with contextlib.suppress(RuntimeError):  # without the mooncake wheel up stops earlier
        assert "--http-metadata" in meta_args(**mooncake)


class _Stop(Exception):
    pass


def test_connections_are_bounded_as_the_routers_http_port() -> None:
    """An idle connection is closed after the head deadline, one address's connections past
    its cap are answered 429 unread, and a real client is still served (pdserve.http_edge)."""
    from pdserve.http_edge import EdgeLimits

    async def main() -> None:
        app = http_metadata.make_app(MemoryBackend())
        limits = EdgeLimits(header_timeout_s=0.5, max_per_peer=2)
        runner, port = await http_metadata.start(app, "127.0.0.1", 0, limits=limits)
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 429"), answer
            writer.close()
            for r, w in idle:  # closed unanswered once the head deadline passed
                assert await asyncio.wait_for(r.read(), 10) == b""
                w.close()
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}{http_metadata.PATH}?key=k"
                status, _ = await _call(http, "PUT", url, b'"v"')
                assert status == 200
                assert await _call(http, "GET", url) == (200, '"v"')
        finally:
            await runner.cleanup()

    asyncio.run(main())
