"""Every Prometheus metric pdserve's services expose, collected from the code that defines
them (not from a list kept by hand), for the tests that keep docs/metrics.md and the Grafana
dashboard honest."""

from __future__ import annotations

import asyncio
import importlib
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

#: Modules that define metrics at import (in pdserve.telemetry.REGISTRY), by the services whose
#: processes load them.
MODULES = {
    "router": [
        "pdserve.services.router.admission",
        "pdserve.services.router.trace",
        "pdserve.services.router.workers",
        "pdserve.services.router.prefix_index",
        "pdserve.services.router.engine_events",
        "pdserve.services.router.kv_check",
    ],
    "prefill": [
        "pdserve.services.prefill.servicer",
        "pdserve.engines.metrics",
        "pdserve.store.client.reads",
        "pdserve.store.client.writes",
        "pdserve.store.api",
    ],
    "decode": [
        "pdserve.services.decode.servicer",
        "pdserve.engines.metrics",
        "pdserve.store.client.reads",
        "pdserve.store.client.writes",
        "pdserve.store.api",
    ],
}
#: What each service's process imports at start (every metric these register must be one
#: of MODULES' above).
ENTRY_POINTS = [
    "pdserve.services.router.server",
    "pdserve.services.router.prefix_index",
    "pdserve.services.prefill.server",
    "pdserve.services.decode.server",
    "pdserve.services.kvstore.master.serve",
    "pdserve.services.kvstore.node.serve",
    "pdserve.services.meta.server",
    "pdserve.services.worker.serve",
    "pdserve.engines.torch_engine.engine",
    "pdserve.store.client",
]
#: Suffixes a metric family's samples carry, by type (what PromQL names).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


@dataclass(frozen=True)
class Metric:
    """One metric family: ``name`` as PromQL queries it (counters with ``_total``)."""

    name: str
    type: str
    labels: tuple[str, ...]

    def series(self) -> set[str]:
        """Every sample name a scrape of this family can hold."""
        base = self.name.removesuffix("_total") if self.type == "counter" else self.name
        return {base + s for s in SUFFIXES[self.type]}


def _queried(name: str, type_: str) -> str:
    return name + "_total" if type_ == "counter" else name


def _from_collectors(collectors) -> dict[str, Metric]:
    out = {}
    for c in collectors:
        if hasattr(c, "_labelnames") and hasattr(c, "_type"):  # prometheus_client metric
            labels = tuple(c._labelnames)
            name = _queried(c._name, c._type)
            out[name] = Metric(name, c._type, labels)
            continue
        for fam in c.collect():  # a custom collector: what it yields at scrape time
            labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
            name = _queried(fam.name, fam.type)
            out[name] = Metric(name, fam.type, tuple(labels))
    return out


def _registered(modules: list[str]) -> dict[str, Metric]:
    from prometheus_client.metrics import MetricWrapperBase

    from pdserve.telemetry import Relayed

    collectors = []
    for m in modules:
        mod = importlib.import_module(m)
        for v in vars(mod).values():
            v = v.metric if isinstance(v, Relayed) else v
            if isinstance(v, MetricWrapperBase):
                collectors.append(v)
    return _from_collectors(collectors)


def registered_at_import() -> set[str]:
    """Queried names of every metric in the process registry once ENTRY_POINTS are loaded."""
    from pdserve.telemetry import REGISTRY

    for m in ENTRY_POINTS:
        importlib.import_module(m)
    return set(_from_collectors(list(REGISTRY._collector_to_names)))


def _master() -> dict[str, Metric]:
    from pdserve.services.kvstore.master.config import MasterConfig
    from pdserve.services.kvstore.master.events import EventHub
    from pdserve.services.kvstore.master.kv_events import KVEventLog
    from pdserve.services.kvstore.master.serve import _StateCollector
    from pdserve.services.kvstore.master.state import MasterState

    cfg = MasterConfig()
    state = MasterState(cfg, store=None, on_event=lambda *a: None)
    return _from_collectors([_StateCollector(state, EventHub(16), threading.Lock(), KVEventLog())])


def _meta() -> dict[str, Metric]:
    from pdserve.services.meta.backends.memory import MemoryBackend
    from pdserve.services.meta.registry import Registry
    from pdserve.services.meta.server import _MetaCollector

    async def make():
        return Registry(MemoryBackend())

    return _from_collectors([_MetaCollector(asyncio.run(make()))])


def _node() -> dict[str, Metric]:
    from pdserve import telemetry
    from pdserve.services.kvstore.node import serve as node

    registry, saved = CollectorRegistry(), telemetry.REGISTRY
    telemetry.REGISTRY = registry  # _export_metrics registers in the process registry
    try:
        node._export_metrics(SimpleNamespace(servers=[], segments=[]))
    finally:
        telemetry.REGISTRY = saved
    return _from_collectors(registry._collector_to_names)


def by_service() -> dict[str, dict[str, Metric]]:
    """{service: {queried name: Metric}} for every pdserve service."""
    out = {service: _registered(mods) for service, mods in MODULES.items()}
    out["kvstore-master"] = _master()
    out["kvstore-node"] = _node()
    out["meta"] = _meta()
    # every service's gRPC server counts its calls (pdserve.grpcutil.start_server), and every
    # service process times its collections (pdserve.lifecycle.run)
    for metrics in out.values():
        metrics.update(_registered(["pdserve.grpcutil", "pdserve.heap"]))
    return out


def all_metrics() -> dict[str, Metric]:
    return {name: m for metrics in by_service().values() for name, m in metrics.items()}


if __name__ == "__main__":  # prints the catalog (a start for docs/metrics.md)
    for service, metrics in by_service().items():
        print(f"## {service}")
        for m in sorted(metrics.values(), key=lambda m: m.name):
            print(f"| `{m.name}` | {m.type} | {', '.join(m.labels) or '-'} |")
