"""Fuzzing gRPC methods: a method table from a service descriptor, a raw-bytes call, and
:class:`GrpcSurface`, the surface every gRPC service here builds on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from pdserve import grpcutil

from .cases import Case
from .invariants import (
    ENDLESS_S,
    FORBIDDEN,
    TIMEOUT_S,
    Dead,
    check_status,
)
from .strategies import (
    corrupt,
    message,
    raw,
)


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    response: type[Message]
    stream: bool


def service_methods(desc: ServiceDescriptor) -> dict[str, Method]:
    """``"Service.Method"`` -> :class:`Method` for each method of a service."""
    return {
        f"{desc.name}.{m.name}": Method(
            f"/{desc.full_name}/{m.name}",
            message_factory.GetMessageClass(m.input_type),
            message_factory.GetMessageClass(m.output_type),
            m.server_streaming,
        )
        for m in desc.methods
    }


HEALTH = service_methods(health_pb2.DESCRIPTOR.services_by_name["Health"])


def grpc_call(
    channel: grpc.Channel,
    m: Method,
    data: bytes,
    metadata: Iterable = (),
    timeout: float = TIMEOUT_S,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Calls ``m`` with raw request bytes; (status, details, raw responses)."""
    out: list[bytes] = []
    try:
        if m.stream:
            call = channel.unary_stream(m.path)(data, timeout=timeout, metadata=tuple(metadata))
            out.extend(call)
        else:
            out.append(channel.unary_unary(m.path)(data, timeout=timeout, metadata=tuple(metadata)))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", out
    return grpc.StatusCode.OK, "", out


#: A base request per method: a function of a small int (to vary keys and ids across cases).
Bases = dict[str, Callable[[int], Message]]


class GrpcSurface:
    """Fuzzes gRPC methods: per case one method, with its valid base request, one field of
    it made hostile, a request hostile throughout, or raw bytes. ``routes`` maps
    ``"Service.Method"`` to its channel and :class:`Method`, ``bases`` gives each fuzzed
    method's valid requests, and ``probe`` is the method whose valid call proves the
    server alive."""

    name = ""
    #: Streams that never end by themselves (watches): read for ENDLESS_S, then cancelled.
    endless: frozenset[str] = frozenset()
    #: Methods served by grpc's own library, whose errors carry no message (grpc.health
    #: answers an unknown service with a bare NOT_FOUND): still fuzzed for the rest.
    bare = frozenset({"Health.Check"})

    def __init__(
        self, routes: dict[str, tuple[grpc.Channel, Method]], bases: Bases, probe: str
    ) -> None:
        self.routes = routes
        self.bases = bases
        self.probe = probe

    @staticmethod
    def route(
        address: str, services: Iterable[ServiceDescriptor]
    ) -> dict[str, tuple[grpc.Channel, Method]]:
        """Routes to every method of ``services`` (and grpc.health) at ``address``."""
        channel = grpcutil.sync_channel(address)
        methods = dict(HEALTH)
        for s in services:
            methods.update(service_methods(s))
        return {name: (channel, m) for name, m in methods.items() if name != "Health.Watch"}

    def cases(self) -> st.SearchStrategy[Case]:
        def of(name: str) -> st.SearchStrategy[Case]:
            m = self.routes[name][1]
            bases = st.integers(0, 3).map(self.bases[name])
            kinds = [
                bases.map(lambda b: Case(name, b)),
                message(m.request.DESCRIPTOR).map(lambda b: Case(name, b)),
                bases.flatmap(raw).map(lambda b: Case(name, b)),
            ]
            if m.request.DESCRIPTOR.fields:
                kinds.append(bases.flatmap(corrupt).map(lambda mp: Case(name, *mp)))
            return st.one_of(kinds)

        return st.sampled_from(sorted(self.bases)).flatmap(of)

    def call(self, case: Case) -> list[bytes]:
        channel, m = self.routes[case.op]
        data = case.data if isinstance(case.data, bytes) else case.data.SerializeToString()
        endless = case.op in self.endless
        code, details, out = grpc_call(
            channel, m, data, case.extra, ENDLESS_S if endless else TIMEOUT_S
        )
        if case.op in self.bare and code not in FORBIDDEN:
            return out
        check_status(code, details, case.path, case.op, endless=endless)
        return out

    def check(self, case: Case) -> None:
        m = self.routes[case.op][1]
        for reply in self.call(case):
            self.check_reply(case, m.response.FromString(reply))

    def check_reply(self, case: Case, resp: Message) -> None:
        pass

    def alive(self) -> None:
        channel, m = self.routes[self.probe]
        data = self.bases[self.probe](0).SerializeToString()
        code, details, _ = grpc_call(channel, m, data, timeout=TIMEOUT_S)
        if code != grpc.StatusCode.OK:
            raise Dead(f"{self.name}: a valid {self.probe} now answers {code.name}: {details}")
