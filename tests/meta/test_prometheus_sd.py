"""Prometheus HTTP service discovery on meta's HTTP port (services/meta/prometheus_sd.py): every
registered service with a metrics port (a router's HTTP port) and meta's own, in http_sd_configs' format, served by the same aiohttp
app as the Mooncake metadata endpoint."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from pdserve.services.meta import http_metadata, prometheus_sd
from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.registry import Registry
from pdserve.v1 import common_pb2, meta_pb2


def test_targets_list_every_metrics_port_with_role_instance_and_model() -> None:
    async def main():
        backend = MemoryBackend()
        reg = Registry(backend)
        await reg.start()
        runner = None
        try:
            for iid, role, model, metrics in (
                ("decode-0", common_pb2.ROLE_DECODE, "smollm2", "10.0.0.2:9100"),
                ("prefill-0", common_pb2.ROLE_PREFILL, "smollm2", "10.0.0.1:9100"),
                ("kv-master", common_pb2.ROLE_KVSTORE_MASTER, "", "10.0.0.3:9200"),
                ("router-0", common_pb2.ROLE_ROUTER, "", ""),  # its OpenAI HTTP port
                ("router-1", common_pb2.ROLE_ROUTER, "", ""),  # no HTTP port: not listed
                ("node-0", common_pb2.ROLE_KVSTORE_NODE, "", "10.0.0.4:9101"),
            ):
                labels = {"metrics": metrics} if metrics else {}
                if iid == "router-0":
                    labels["http"] = "10.0.0.5:8000"
                instance = meta_pb2.Instance(
                    instance_id=iid, role=role, address="10.0.0.9:1", model=model, labels=labels
                )
                await reg.register(instance, 30_000)
            app = http_metadata.make_app(backend)
            prometheus_sd.add_route(app, reg, own_metrics="10.0.0.6:9300")
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}{prometheus_sd.PATH}") as resp,
            ):
                assert resp.status == 200 and resp.content_type == "application/json"
                return json.loads(await resp.text())
        finally:
            if runner is not None:
                await runner.cleanup()
            await reg.close()

    groups = asyncio.run(main())
    assert groups == [
        {"targets": ["10.0.0.2:9100"],
         "labels": {"pdserve_role": "decode", "pdserve_instance": "decode-0",
                    "pdserve_model": "smollm2"}},
        {"targets": ["10.0.0.3:9200"],
         "labels": {"pdserve_role": "kvstore-master", "pdserve_instance": "kv-master"}},
        {"targets": ["10.0.0.6:9300"],
         "labels": {"pdserve_role": "meta", "pdserve_instance": "meta"}},
        {"targets": ["10.0.0.4:9101"],
         "labels": {"pdserve_role": "kvstore-node", "pdserve_instance": "node-0"}},
        {"targets": ["10.0.0.1:9100"],
         "labels": {"pdserve_role": "prefill", "pdserve_instance": "prefill-0",
                    "pdserve_model": "smollm2"}},
        {"targets": ["10.0.0.5:8000"],
         "labels": {"pdserve_role": "router", "pdserve_instance": "router-0"}},
    ]  # fmt: skip
