"""The master's re-replication loop: every pass takes a few repair jobs from the state
(:meth:`~.state.MasterState.repair_jobs`), asks each target's node to make the copy
(``KVNodeService.CopyReplica`` at the address the node mounted with) and records each
outcome (:meth:`~.state.MasterState.repair_done`).

The request carries the source replica with a read grant and the target with a write grant,
both as long as the repair lease; the node reads the source over the data plane and writes
its own segment. The master opens no data-plane transport and never holds the payload.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve import grpcutil
from pdserve.services.kvstore.master.repair import REPAIR_LEASE_S, RepairJob
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.store.grants import OP_READ, OP_WRITE
from pdserve.v1 import kvstore_pb2 as pb
from pdserve.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

#: How long one CopyReplica call may take (seconds).
COPY_TIMEOUT_S = 30.0

#: (job, the target node's KVNodeService address, the request to send it)
Copy = tuple[RepairJob, str, pb.CopyReplicaRequest]


class RepairLoop:
    """Runs the copies of :class:`~.repair.Repairer`'s jobs through the nodes.
    ``stub_for(address)`` gives the KVNodeService stub of a node (tests pass a fake)."""

    def __init__(
        self,
        handlers: MasterHandlers,
        limit: int,
        stub_for: Callable[[str], kvstore_pb2_grpc.KVNodeServiceStub] | None = None,
    ) -> None:
        self.handlers = handlers
        self.limit = limit
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.stub_for = stub_for or self._stub

    def _stub(self, address: str) -> kvstore_pb2_grpc.KVNodeServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpcutil.channel(address, role="node")
        return kvstore_pb2_grpc.KVNodeServiceStub(channel)

    def take(self) -> list[Copy]:
        """The next copies, each with its target node's address and its request."""
        h = self.handlers
        with h.lock:
            state = h.state
            expires = int(state.clock.wall_ms() + REPAIR_LEASE_S * 1000)
            out = []
            for job in state.repair_jobs(self.limit):
                reps = pb.ReplicaListResult()
                h.fill(reps.replicas, [job.source], job.size, OP_READ, expires)
                h.fill(reps.replicas, [job.target], job.size, OP_WRITE, expires)
                request = pb.CopyReplicaRequest(
                    key=job.key, size=job.size, source=reps.replicas[0], target=reps.replicas[1]
                )
                out.append((job, state.node_address(job.target.node_id), request))
            return out

    async def _copy(self, address: str, request: pb.CopyReplicaRequest) -> bool:
        if not address:
            log.warning(
                "re-replication of %r: node %s mounted without its address; cannot ask it",
                request.key,
                request.target.node_id,
            )
            return False
        try:
            await self.stub_for(address).CopyReplica(request, timeout=COPY_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "re-replication of %r onto node %s failed: %s %s",
                request.key,
                request.target.node_id,
                exc.code().name,
                exc.details(),
            )
            return False

    def _record(self, outcomes: list[tuple[RepairJob, bool]]) -> None:
        with self.handlers.lock:
            for job, ok in outcomes:
                self.handlers.state.repair_done(job, ok)

    async def run_once(self) -> int:
        """One pass; returns how many copies were made."""
        copies = await asyncio.to_thread(self.take)
        if not copies:
            return 0
        oks = await asyncio.gather(*(self._copy(address, req) for _job, address, req in copies))
        await asyncio.to_thread(
            self._record, [(c[0], ok) for c, ok in zip(copies, oks, strict=True)]
        )
        return sum(oks)

    async def run(self, interval_s: float) -> None:
        """Passes every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.run_once()
            except Exception:  # keep the master up; the next pass retries
                log.exception("re-replication pass failed")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
