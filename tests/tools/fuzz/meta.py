"""The meta service's surface: MetaService and the Mooncake ``/metadata`` HTTP endpoint
(:class:`Meta`)."""

from __future__ import annotations

import json
import urllib.parse

from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from pdserve.v1 import common_pb2, meta_pb2

from .cases import Case
from .grpc_surface import Bases, GrpcSurface
from .http import JSON, RAW_BODIES, http_call
from .invariants import (
    Dead,
    Violation,
    check_http,
)
from .strategies import (
    pick,
    texts,
)


def _instance(k: int) -> meta_pb2.Instance:
    return meta_pb2.Instance(
        instance_id=f"fz-{k}",
        role=common_pb2.ROLE_DECODE,
        address="127.0.0.1:9000",
        model="m",
        max_running=4,
        kv_capacity_bytes=1 << 30,
        load=common_pb2.Load(queue_length=1, kv_usage=0.5),
        labels={"metrics": "127.0.0.1:9001"},
    )


META_BASES: Bases = {
    "MetaService.Register": lambda k: meta_pb2.RegisterRequest(instance=_instance(k), ttl_ms=5000),
    "MetaService.Heartbeat": lambda k: meta_pb2.MetaHeartbeatRequest(
        lease_id=f"fz-lease-{k}", load=common_pb2.Load(running_requests=2, kv_usage=0.25)
    ),
    "MetaService.Deregister": lambda k: meta_pb2.DeregisterRequest(lease_id=f"fz-lease-{k}"),
    "MetaService.ListInstances": lambda k: meta_pb2.ListInstancesRequest(
        role=common_pb2.ROLE_DECODE, model="m"
    ),
    "MetaService.WatchInstances": lambda k: meta_pb2.WatchInstancesRequest(
        role=common_pb2.ROLE_DECODE, include_existing=k % 2 == 0
    ),
    "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
}


class Meta(GrpcSurface):
    """MetaService, and the Mooncake /metadata HTTP endpoint (hostile methods, keys and
    bodies)."""

    name = "meta"
    endless = frozenset({"MetaService.WatchInstances"})

    def __init__(self, grpc_address: str, http_address: str) -> None:
        routes = self.route(grpc_address, [meta_pb2.DESCRIPTOR.services_by_name["MetaService"]])
        super().__init__(routes, META_BASES, "MetaService.ListInstances")
        self.http = http_address

    def cases(self) -> st.SearchStrategy[Case]:
        key = st.sampled_from([None, "fz-key"]) | texts(small=True) | st.just("k" * 1025)
        body = pick([b'{"a": 1}', *RAW_BODIES]) | JSON.map(lambda v: json.dumps(v).encode())
        method = st.sampled_from(["GET", "PUT", "DELETE", "POST", "HEAD"])

        def http_case(method: str, key: str | None, body: bytes) -> Case:
            bad = key is None or not key.strip() or len(key.strip()) > 1024  # the documented rule
            return Case(f"{method} /metadata", body, "key" if bad else None, key)

        return super().cases() | st.builds(http_case, method, key, body)

    def check(self, case: Case) -> None:
        if not case.op.endswith(" /metadata"):
            return super().check(case)
        method, target = case.op.split(" ", 1)
        if case.extra is not None:
            target += "?" + urllib.parse.urlencode({"key": case.extra})
        status, reply = http_call(self.http, method, target, case.data)
        if status == 507 and (b"http_max_keys" in reply or b"http_max_total_bytes" in reply):
            return  # the documented caps on stored keys and bytes: a full store, not a fault
        check_http(status, reply, case.path, case.op)
        if case.path and status != 400:
            raise Violation(f"{case.op}: a bad key answered {status}, not 400")

    def alive(self) -> None:
        super().alive()
        status, reply = http_call(self.http, "PUT", "/metadata?key=fz-alive", b'{"ok": 1}')
        if status != 200:
            raise Dead(f"meta: a valid PUT /metadata now answers {status}: {reply[:200]!r}")
