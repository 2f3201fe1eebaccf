"""The master's segment table: the storage nodes, their segments and each segment's
allocator, placement of new replicas across them, and the nodes' heartbeat clocks.

It holds the :class:`~.types.SegmentState` and :class:`~.types.NodeState` records and knows
nothing of objects: what a segment's coming or going does to the objects on it is
:mod:`.membership`'s business.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from pdserve.services.kvstore.master.allocator import OffsetAllocator
from pdserve.services.kvstore.master.placement import PlacementStrategy, make_strategies
from pdserve.services.kvstore.master.types import NodeState, ReplicaLoc, SegmentState
from pdserve.v1 import kvstore_pb2 as pb


class SegmentTable(Mapping[str, SegmentState]):
    """A read-only mapping of the segments (alive, and dead ones kept for their dormant
    replicas), plus the nodes and the calls that change either."""

    def __init__(self, placement_seed: int | None = None) -> None:
        self._segments: dict[str, SegmentState] = {}
        self._nodes: dict[str, NodeState] = {}
        self._strategies: dict[int, PlacementStrategy] = make_strategies(placement_seed)

    # ------------------------------------------------------------------ the mapping

    def __getitem__(self, segment_id: str) -> SegmentState:
        return self._segments[segment_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._segments)

    def __len__(self) -> int:
        return len(self._segments)

    def alive(self, segment_id: str) -> SegmentState | None:
        """The segment ``segment_id`` when it is mounted and alive."""
        seg = self._segments.get(segment_id)
        return seg if seg is not None and seg.alive else None

    def is_current(self, seg: SegmentState) -> bool:
        """Whether ``seg`` is still the live segment under its id (a remount replaces it)."""
        return self._segments.get(seg.segment_id) is seg and seg.alive

    def live(self, tier: int | None = pb.STORAGE_TIER_MEMORY) -> list[SegmentState]:
        """The alive segments of ``tier`` (None = of every tier)."""
        return [s for s in self._segments.values() if s.alive and (tier is None or s.tier == tier)]

    def capacity(self, tier: int = pb.STORAGE_TIER_MEMORY) -> int:
        """Bytes of the alive segments of ``tier``."""
        return sum(s.capacity for s in self.live(tier))

    def used(self, tier: int = pb.STORAGE_TIER_MEMORY) -> int:
        """Bytes allocated in the alive segments of ``tier``."""
        return sum(s.used for s in self.live(tier))

    def disk_of(self, node_id: str) -> SegmentState | None:
        """The alive disk segment of ``node_id`` (None = it has no disk tier)."""
        return next((s for s in self.live(pb.STORAGE_TIER_DISK) if s.node_id == node_id), None)

    # ------------------------------------------------------------------ segments

    def add(
        self,
        segment_id: str,
        node_id: str,
        size: int,
        endpoints: Sequence[pb.Endpoint],
        tier: int = pb.STORAGE_TIER_MEMORY,
    ) -> SegmentState:
        """A new, empty segment under ``segment_id`` (replacing a dead one of that id)."""
        seg = SegmentState(
            segment_id, node_id, size, list(endpoints), OffsetAllocator(size), tier=tier
        )
        self._segments[segment_id] = seg
        return seg

    @staticmethod
    def refresh(seg: SegmentState, endpoints: Sequence[pb.Endpoint]) -> None:
        """An idempotent remount: the segment keeps its allocations, takes new endpoints."""
        seg.endpoints = list(endpoints)

    @staticmethod
    def kill(seg: SegmentState) -> None:
        """Marks ``seg`` dead and forgets its allocations (nothing is placed on it again)."""
        seg.alive = False
        seg.allocator = OffsetAllocator(seg.size)

    def remove(self, segment_id: str) -> SegmentState | None:
        return self._segments.pop(segment_id, None)

    def remove_dead(self, segment_id: str) -> None:
        """Forgets ``segment_id`` if it is a dead segment."""
        seg = self._segments.get(segment_id)
        if seg is not None and not seg.alive:
            del self._segments[segment_id]

    # ------------------------------------------------------------------ space

    def strategy(self, placement: int) -> PlacementStrategy | None:
        return self._strategies.get(placement)

    def try_place(
        self,
        strategy: PlacementStrategy,
        size: int,
        n_rep: int,
        exclude_nodes: Collection[str] = (),
        tier: int = pb.STORAGE_TIER_MEMORY,
    ) -> list[ReplicaLoc] | None:
        """``n_rep`` new ranges of ``size`` bytes in ``tier``'s segments on distinct nodes,
        none of ``exclude_nodes``, in ``strategy``'s order; None (nothing taken) when they do
        not fit."""
        live = [s for s in self.live(tier) if s.allocator.can_fit(size)]
        chosen: list[ReplicaLoc] = []
        used_nodes: set[str] = set(exclude_nodes)
        for seg in strategy.order(live, size):
            if seg.node_id in used_nodes:
                continue
            off = seg.allocator.allocate(size)
            if off is None:
                continue
            chosen.append(ReplicaLoc(seg.segment_id, seg.node_id, off, tier=seg.tier))
            used_nodes.add(seg.node_id)
            if len(chosen) == n_rep:
                return chosen
        self.free(chosen)  # not enough: give back what we took
        return None

    def free(self, replicas: Sequence[ReplicaLoc]) -> None:
        """Gives the ranges of ``replicas`` back to their alive segments."""
        for r in replicas:
            seg = self._segments.get(r.segment_id)
            if seg is not None and seg.alive:
                seg.allocator.release(r.offset)

    @staticmethod
    def place_in(seg: SegmentState, size: int) -> ReplicaLoc | None:
        """A new range of ``size`` bytes in ``seg`` (None = no room)."""
        off = seg.allocator.allocate(size)
        return None if off is None else ReplicaLoc(seg.segment_id, seg.node_id, off, tier=seg.tier)

    @staticmethod
    def reserve(seg: SegmentState, ranges: Sequence[tuple[int, int]]) -> list[str]:
        """Reserves ``(offset, size)`` ranges in ``seg``; per range "" or why not."""
        return seg.allocator.reserve_many(ranges)

    # ------------------------------------------------------------------ nodes

    def node(self, node_id: str) -> NodeState | None:
        return self._nodes.get(node_id)

    def nodes(self) -> list[NodeState]:
        return list(self._nodes.values())

    def alive_nodes(self) -> int:
        return len(self._nodes)

    def join(self, node_id: str, segment_id: str, now: float, address: str = "") -> None:
        """Records that ``node_id`` (alive at ``now``) holds ``segment_id``; ``address`` is
        its KVNodeService address ("" = keep the one known)."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeState(node_id, now)
        node.last_heartbeat = now
        node.segment_ids.add(segment_id)
        if address:
            node.address = address

    def leave(self, node_id: str, segment_id: str, *, forget_empty: bool = True) -> None:
        """``segment_id`` left ``node_id``; a node left with no segment is forgotten unless
        ``forget_empty`` is False."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.segment_ids.discard(segment_id)
            if forget_empty and not node.segment_ids:
                del self._nodes[node_id]

    def forget_node(self, node_id: str) -> None:
        del self._nodes[node_id]

    def beat(self, node_id: str, now: float) -> NodeState | None:
        """Records a heartbeat of ``node_id``; None when the node is unknown."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_heartbeat = now
        return node

    def forgive(self, stalled: float, now: float) -> None:
        """The master did not run for ``stalled`` seconds: that time is not held against
        any node's heartbeats."""
        for node in self._nodes.values():
            node.last_heartbeat = min(now, node.last_heartbeat + stalled)

    def overdue(self, now: float, dead_after: float) -> list[NodeState]:
        """Nodes whose last heartbeat is more than ``dead_after`` seconds old."""
        return [n for n in self._nodes.values() if now - n.last_heartbeat > dead_after]

    def unaddressed(self) -> set[str]:
        """The nodes that mounted without a KVNodeService address (the master cannot ask
        them to copy a replica)."""
        return {n.node_id for n in self._nodes.values() if not n.address}

    def address_of(self, node_id: str) -> str:
        """The KVNodeService address of ``node_id`` ("" = unknown)."""
        node = self._nodes.get(node_id)
        return node.address if node is not None else ""
