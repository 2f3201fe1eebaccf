"""Prometheus HTTP service discovery on meta's HTTP port: ``GET /prometheus/targets`` lists the
``/metrics`` endpoint of every registered service that has one (the ``metrics`` label workers
and the KV master register), in Prometheus' ``http_sd_configs`` format, so one static scrape
config finds the metrics ports ``pdserve up`` picks at random:

    scrape_configs:
      - job_name: pdserve
        http_sd_configs:
          - url: https://META_HOST:50080/prometheus/targets
            tls_config: {ca_file: .pdserve/run/certs/ca.crt}

Each target carries the labels ``pdserve_role``, ``pdserve_instance`` and ``pdserve_model``.
Like the metadata GETs, the list is open: it holds addresses and names, no request data."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdserve.enums import ROLE

if TYPE_CHECKING:
    from aiohttp import web

    from pdserve.services.meta.registry import Registry

PATH = "/prometheus/targets"


async def targets(registry: Registry) -> list[dict[str, Any]]:
    """The http_sd_configs target groups of every registered instance with a metrics port."""
    out = []
    for inst in await registry.list():
        address = inst.labels.get("metrics", "")
        if not address:
            continue
        labels = {"pdserve_role": ROLE.name(inst.role), "pdserve_instance": inst.instance_id}
        if inst.model:
            labels["pdserve_model"] = inst.model
        out.append({"targets": [address], "labels": labels})
    return sorted(out, key=lambda group: group["labels"]["pdserve_instance"])


def add_route(app: web.Application, registry: Registry) -> None:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        body = json.dumps(await targets(registry))
        return web.Response(text=body, content_type="application/json")

    app.router.add_get(PATH, handle)
