"""Prometheus HTTP service discovery on meta's HTTP port: ``GET /prometheus/targets`` lists the
``/metrics`` endpoint of every registered service that has one (the ``metrics`` label workers,
the KV master and the storage nodes register; a router's OpenAI HTTP port) and meta's own, in
Prometheus' ``http_sd_configs`` format, so one static scrape config finds the metrics ports
``pdserve up`` picks at random:

    scrape_configs:
      - job_name: pdserve
        http_sd_configs:
          - url: https://META_HOST:50080/prometheus/targets
            tls_config: {ca_file: .pdserve/run/certs/ca.crt}
        # the metrics ports' key, where they take one (beyond loopback with TLS on:
        # pdserve.telemetry.configure_metrics; `pdserve up` gives them its API key)
        authorization: {credentials_file: .pdserve/run/api_key}

Each target carries the labels ``pdserve_role``, ``pdserve_instance`` and ``pdserve_model``.
The list is open: it holds addresses and names, no request data."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdserve.enums import ROLE
from pdserve.v1 import common_pb2

if TYPE_CHECKING:
    from aiohttp import web

    from pdserve.services.meta.registry import Registry

PATH = "/prometheus/targets"


async def targets(registry: Registry, own_metrics: str = "") -> list[dict[str, Any]]:
    """The http_sd_configs target groups of every registered instance with a metrics endpoint
    (the router's is its OpenAI HTTP port) and of this meta (``own_metrics``)."""
    out = []
    if own_metrics:
        meta = {"pdserve_role": "meta", "pdserve_instance": "meta"}
        out.append({"targets": [own_metrics], "labels": meta})
    for inst in await registry.list():
        address = inst.labels.get("metrics", "") or _router_http(inst)
        if not address:
            continue
        labels = {"pdserve_role": ROLE.name(inst.role), "pdserve_instance": inst.instance_id}
        if inst.model:
            labels["pdserve_model"] = inst.model
        out.append({"targets": [address], "labels": labels})
    return sorted(out, key=lambda group: group["labels"]["pdserve_instance"])


def _router_http(inst: Any) -> str:
    """A router's /metrics is on its OpenAI HTTP port (it takes the API key unless ``metrics_open`` or bound to loopback)."""
    return inst.labels.get("http", "") if inst.role == common_pb2.ROLE_ROUTER else ""


def add_route(app: web.Application, registry: Registry, *, own_metrics: str = "") -> None:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        body = json.dumps(await targets(registry, own_metrics))
        return web.Response(text=body, content_type="application/json")

    app.router.add_get(PATH, handle)
