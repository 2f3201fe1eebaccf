"""Which data-plane transport serves which replica: shm when the replica's node is on this
host and its segment file is this user's to map, else tcp, else mooncake
(:data:`~pdserve.store.transports.PREFERENCE`), or the one transport the client was told to
use; replicas of a node that just failed a transfer go
last for a while."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from pdserve.enums import TRANSPORT
from pdserve.store.transports import PREFERENCE
from pdserve.store.transports.base import Transport
from pdserve.v1 import kvstore_pb2

#: How long a node that failed a read is tried after the other replicas (seconds).
SUSPECT_S = 5.0

_UNROUTED: Any = object()


class ReplicaRoutes:
    """The client's transports (each opened at first use) and the nodes it suspects.
    ``transport``: "auto" or the one transport to use. Thread-safe."""

    def __init__(self, transport: str, host_id: str, timeout_s: float) -> None:
        self.transport = transport
        self.host_id = host_id
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        #: Transport name -> the open transport.
        self.transports: dict[str, Transport] = {}
        #: Node id -> monotonic time until which its replicas go last (it just failed).
        self.suspect_until: dict[str, float] = {}

    def get(self, name: str) -> Transport:
        """The transport ``name``, opened at first use."""
        with self.lock:
            t = self.transports.get(name)
            if t is None:
                if name == "shm":
                    from pdserve.store.transports.shm import ShmTransport

                    t = ShmTransport(self.host_id)
                elif name == "tcp":
                    from pdserve.store.transports.tcp_client import TcpTransport

                    t = TcpTransport(self.timeout_s)
                else:
                    from pdserve.store.transports.mooncake import MooncakeTransport

                    t = MooncakeTransport()
                self.transports[name] = t
            return t

    def route(self, replica: kvstore_pb2.Replica) -> Transport | None:
        """The best transport that reaches ``replica``, or None."""
        offered = {TRANSPORT.names.get(ep.transport) for ep in replica.endpoints}
        names = PREFERENCE if self.transport == "auto" else (self.transport,)
        for name in names:
            if name not in offered:
                continue
            transport = self.get(name)
            # shm: a segment on this host whose file this user may map (else tcp)
            if name == "shm" and not transport.usable(replica):
                continue
            return transport
        return None

    def ordered(
        self,
        replicas: Sequence[kvstore_pb2.Replica],
        routes: dict[str, Transport | None] | None = None,
    ) -> list[tuple[kvstore_pb2.Replica, Transport]]:
        """Replicas that some allowed transport reaches, memory before disk, best transport
        first. ``routes``
        memoizes the route per segment within one batch (its endpoints cannot change there)."""
        routed = []
        for r in replicas:
            if routes is None:
                t = self.route(r)
            else:
                t = routes.get(r.segment_id, _UNROUTED)
                if t is _UNROUTED:
                    t = routes[r.segment_id] = self.route(r)
            if t is not None:
                routed.append((r, t))
        if len(routed) > 1:
            now = time.monotonic()
            # A node that just failed a transfer goes last until SUSPECT_S passes, so a dead
            # or cut-off node costs one timeout, not one per object, before the master
            # notices it.
            # Memory copies before disk copies (a disk tier's read pays the device).
            routed.sort(
                key=lambda rt: (
                    self.suspect_until.get(rt[0].node_id, 0.0) > now,
                    rt[0].tier,
                    PREFERENCE.index(rt[1].name),
                )
            )
        return routed

    def suspect(self, node_id: str) -> None:
        """Tries ``node_id``'s replicas last for SUSPECT_S (a transfer with it failed)."""
        self.suspect_until[node_id] = time.monotonic() + SUSPECT_S

    def close(self) -> None:
        with self.lock:
            transports = list(self.transports.values())
            self.transports.clear()
        for t in transports:
            t.close()
