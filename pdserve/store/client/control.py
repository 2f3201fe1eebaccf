"""The store client's control path to the master: its control wire
(:mod:`pdserve.store.wire`, the master's messages without HTTP/2) when the master offers one,
else gRPC. Payload never travels here, except objects small enough to ride inline with their
put (the master says how small: ``inline_max``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from pdserve import errors, grpcutil, tracing
from pdserve.store.wire import METHOD_IDS as WIRE_METHODS
from pdserve.store.wire import VERSION as WIRE_VERSION
from pdserve.store.wire import WireClient, WireUnreachable
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

#: How long a client uses gRPC before it looks for the master's control wire again after the
#: wire was off or unreachable (seconds).
WIRE_RETRY_S = 1.0
#: Longest a call may wait for one of several masters (an HA list) before the client tries the
#: next (seconds): a master answers in milliseconds, and a paused leader must be left soon
#: after its lease ends (2 s by default) for reads to resume within 5 s.
HA_CALL_TIMEOUT_S = 1.5


class MasterLink:
    """Calls to one master, by RPC name, over the wire or gRPC. ``control``: "auto" (the wire
    when the master has one) or "grpc" (gRPC only). Thread-safe."""

    def __init__(self, master_address: str, timeout_s: float, control: str = "auto") -> None:
        self.address = master_address
        #: Several masters (HA): calls follow the leader (pdserve.failover), each shorter.
        self.failover = "," in master_address
        self.timeout_s = min(timeout_s, HA_CALL_TIMEOUT_S) if self.failover else timeout_s
        self.control = control
        self.channel = grpcutil.sync_channel(master_address, role="master")
        self.stub = kvstore_pb2_grpc.KVMasterServiceStub(self.channel)
        self.lock = threading.Lock()
        #: The master's control wire; None = gRPC (off, unreachable, or not looked up yet).
        self.wire: WireClient | None = None
        #: When the wire was last looked up (monotonic).
        self.wire_checked = -WIRE_RETRY_S
        #: Largest object that travels inline with its put (from ``GetControlWire``).
        self.inline_max = 0

    def call(self, method: str, request: Any) -> Any:
        """The master's answer to RPC ``method``; a failure raises the
        :class:`~pdserve.errors.PdserveError` of its status. Methods the control wire does
        not carry (the admin calls: namespaces, quarantine) go over gRPC."""
        wire = self.wire_client() if method in WIRE_METHODS else None
        if not tracing.enabled():
            return self._call(wire, method, request)
        attrs = {"rpc.method": method, "pdserve.control": "grpc" if wire is None else "wire"}
        name = f"pdserve.kvstore.master/{method}"
        with tracing.span(name, attrs, kind=SpanKind.CLIENT, root=False):
            return self._call(wire, method, request)

    def _call(self, wire: WireClient | None, method: str, request: Any) -> Any:
        if wire is not None:
            try:
                return wire.call(method, request)
            except (errors.DeadlineExceeded, errors.Unavailable) as exc:
                if not self.failover:
                    raise
                # this leader stopped answering: gRPC tries the next master now
                log.info("%s; using gRPC", exc)
                self.channel.current_failed()  # type: ignore[attr-defined]
                with self.lock:
                    if self.wire is wire:
                        self.wire, self.wire_checked = None, time.monotonic()
                wire.close()
            except WireUnreachable as exc:
                # The master restarted (a new wire port) or its wire is cut off: gRPC says
                # which, and the wire is looked up again after WIRE_RETRY_S.
                log.info("%s; using gRPC", exc)
                with self.lock:
                    if self.wire is wire:
                        self.wire, self.wire_checked = None, time.monotonic()
                wire.close()
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            detail = exc.details()  # type: ignore[attr-defined]
            raise errors.from_status(
                code, f"kvstore master {self.address} {method}: {code.name}: {detail}"
            ) from exc

    @property
    def path(self) -> str:
        """``"wire"`` when calls go to the master's control wire, else ``"grpc"``."""
        return "wire" if self.wire_client() is not None else "grpc"

    def wire_client(self) -> WireClient | None:
        """The master's control wire, looked up with ``GetControlWire`` at first use and
        again WIRE_RETRY_S after it was off or unreachable; None means gRPC. The same answer
        sets :attr:`inline_max`."""
        with self.lock:
            if self.wire is not None or time.monotonic() - self.wire_checked < WIRE_RETRY_S:
                return self.wire
            self.wire_checked = time.monotonic()
        try:
            info = self.stub.GetControlWire(
                kvstore_pb2.ControlWireRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            log.debug("GetControlWire failed: %s", exc)
            return None
        self.inline_max = info.inline_max_bytes
        if self.control != "auto":
            self.wire_checked = float("inf")  # gRPC by choice: no need to ask again
            return None
        if not info.port or info.version != WIRE_VERSION:
            return None
        if not info.host and "," in self.address:
            return None  # a list of masters, and this one did not say which it is: gRPC
        host = info.host or self.address.rpartition(":")[0]
        wire = WireClient(host, info.port, self.timeout_s)
        with self.lock:
            if self.wire is None:
                self.wire = wire
                return wire
        wire.close()
        return self.wire

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
        self.channel.close()
