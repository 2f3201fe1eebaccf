"""The KV store master process: serves KVMasterService, runs housekeeping, exports metrics.

``serve(cfg, stop)`` starts the control wire and the gRPC server, announces READY (grpc
address, metrics port, wire port), ticks :meth:`MasterState.tick` and runs a
re-replication pass (:class:`~.repair_loop.RepairLoop`: the nodes copy, the master only
asks) every ``tick_interval_ms`` until ``stop`` is set, then drains.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from pdserve.identity import advertised
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.ha import EtcdLink, EtcdMetadataStore, Leadership

__all__ = ["serve"]

log = logging.getLogger(__name__)


class _StateCollector:
    """Prometheus view of a MasterState (read at scrape time; no double bookkeeping)."""

    def __init__(self, state, hub, lock, kv_events) -> None:
        self.state = state
        self.hub = hub
        self.lock = lock
        self.kv_events = kv_events

    def describe(self):
        return []

    def collect(self):
        with self.lock:  # scrapes run on the metrics server's thread
            return list(self._collect())

    def _collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from pdserve.v1 import kvstore_pb2 as pb

        s, c = self.state, self.state.counters
        p = "pdserve_kvstore_master_"
        for name, value, doc in (
            ("puts", c.puts, "committed puts"),
            ("gets", c.gets, "keys asked for replica lists"),
            ("get_hits", c.get_hits, "keys found by replica-list lookups"),
            ("evictions", c.evictions, "objects evicted"),
            ("removals", c.removals, "objects removed on request"),
            ("ttl_expired", c.ttl_expired, "objects removed at the end of their TTL"),
            ("put_timeouts", c.put_timeouts, "unfinished puts reclaimed after the put timeout"),
            ("node_deaths", c.node_deaths, "nodes declared dead after missed heartbeats"),
            (
                "node_dead_objects",
                c.node_dead_objects,
                "objects hidden with their last live replica (dormant until it remounts)",
            ),
            ("stalls", c.stalls, "housekeeping passes late enough not to count missed beats"),
            ("repairs", c.repairs, "replicas re-made on another node after one was lost"),
            (
                "repair_failures",
                c.repair_failures,
                "re-replication copies that failed (the object is queued again)",
            ),
            ("demotions", c.demotions, "copies moved down to a node's disk tier"),
            ("promotions", c.promotions, "disk-only objects copied back to memory after a read"),
            (
                "memory_evictions",
                c.memory_evictions,
                "memory copies evicted while a disk copy kept the object",
            ),
            ("tier_move_failures", c.tier_move_failures, "moves between tiers that failed"),
            ("dropped_objects", c.dropped_objects, "objects removed by DropNamespaces"),
            (
                "quarantined_misses",
                c.quarantined_misses,
                "keys answered as not found because their fingerprint is quarantined",
            ),
            ("prefix_queries", c.prefix_queries, "LongestPrefix calls"),
            ("prefix_hit_keys", c.prefix_hit_keys, "sum of LongestPrefix answers (keys)"),
            ("events_dropped", self.hub.dropped, "events dropped for slow watchers"),
            (
                "kv_event_batches",
                self.kv_events.seq + 1,
                "KV event batches published (SubscribeKVEvents, ZMQ)",
            ),
            (
                "kv_event_cut_off",
                self.kv_events.cut_off,
                "SubscribeKVEvents subscribers cut off for falling too far behind",
            ),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, value, doc in (
            ("objects", len(s.objects), "committed objects"),
            ("under_replicated", s.under_replicated(), "objects waiting for a new replica"),
            ("pending_puts", s.objects.pending_count, "puts started and not ended"),
            ("used_bytes", s.objects.used_bytes, "bytes in committed objects"),
            (
                "inline_bytes",
                s.objects.inline_bytes,
                "bytes of small objects kept in memory, served inline",
            ),
            ("allocated_bytes", s.segments.used(), "bytes allocated in alive memory segments"),
            ("capacity_bytes", s.segments.capacity(), "bytes of alive memory segments"),
            (
                "disk_allocated_bytes",
                s.segments.used(pb.STORAGE_TIER_DISK),
                "bytes allocated in alive disk segments",
            ),
            (
                "disk_capacity_bytes",
                s.segments.capacity(pb.STORAGE_TIER_DISK),
                "bytes of alive disk segments (the tier below memory)",
            ),
            ("alive_nodes", s.alive_nodes(), "storage nodes alive"),
            ("dormant_objects", len(s.dormant), "persisted objects waiting for their segment"),
            (
                "quarantined_fingerprints",
                len(s.namespaces.quarantined()),
                "model fingerprints quarantined (their chunks read as not found)",
            ),
            ("fingerprints", len(s.namespaces), "model fingerprints the master knows"),
            ("watchers", len(self.hub.subscribers), "WatchEvents subscribers"),
            ("kv_event_subscribers", self.kv_events.subscribers, "SubscribeKVEvents streams"),
        ):
            yield GaugeMetricFamily(p + name, doc, value=value)
        yield from _tenant_families(s.quotas.report(), p)


def _tenant_families(report, p: str):
    """Each tenant's bytes per tier, pinned bytes and evictions by reason (:mod:`.quotas`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    stored = GaugeMetricFamily(
        p + "tenant_bytes", "bytes of a tenant's copies in a tier", labels=["tenant", "tier"]
    )
    pinned = GaugeMetricFamily(
        p + "tenant_pinned_bytes", "bytes of a tenant's pinned objects", labels=["tenant"]
    )
    evictions = CounterMetricFamily(
        p + "tenant_evictions",
        "copies evicted, by tenant and reason (over_share: the tenant was over its share)",
        labels=["tenant", "reason"],
    )
    for t in report:
        stored.add_metric([t.tenant, "memory"], t.memory_bytes)
        stored.add_metric([t.tenant, "disk"], t.disk_bytes)
        pinned.add_metric([t.tenant], t.pinned_bytes)
        evictions.add_metric([t.tenant, "over_share"], t.evictions_over_share)
        evictions.add_metric([t.tenant, "normal"], t.evictions_normal)
    yield from (stored, pinned, evictions)


async def _lead(cfg: MasterConfig, stop: asyncio.Event) -> Leadership | None:
    """Stands by until this master leads (its Leadership) or ``stop`` is set (None). A standby
    announces READY with ``standby: true`` and binds nothing."""
    from pdserve.lifecycle import announce_ready

    link = await asyncio.to_thread(EtcdLink, cfg.etcd_access())
    address = advertised(cfg, cfg.port)
    leadership = Leadership(link, cfg.ha_prefix, address, cfg.ha_lease_s)
    announce_ready("kvstore-master", grpc=address, standby=True)
    campaign = asyncio.ensure_future(leadership.campaign())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({campaign, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if campaign.done() and campaign.exception() is None:
        return leadership
    campaign.cancel()
    link.close()
    if campaign.done() and not campaign.cancelled() and campaign.exception() is not None:
        raise campaign.exception()
    return None


async def serve(cfg: MasterConfig, stop: asyncio.Event) -> None:
    """Runs the master until ``stop`` is set."""
    from pdserve import grpcutil, telemetry
    from pdserve.lifecycle import announce_ready
    from pdserve.services.kvstore.master.events import EventHub
    from pdserve.services.kvstore.master.kv_events import KVEventLog, ZmqPublisher
    from pdserve.services.kvstore.master.persistence import MetadataStore
    from pdserve.services.kvstore.master.repair_loop import RepairLoop
    from pdserve.services.kvstore.master.servicer import KVMasterServicer, MasterHandlers
    from pdserve.services.kvstore.master.state import MasterState
    from pdserve.services.kvstore.master.wire import WireServer
    from pdserve.v1 import kvstore_pb2 as pb
    from pdserve.v1 import kvstore_pb2_grpc

    hub = EventHub(cfg.event_queue_size)
    leadership = None
    if cfg.ha_etcd:
        leadership = await _lead(cfg, stop)
        if leadership is None:
            return  # stopped while standing by
        store = EtcdMetadataStore(leadership.link, leadership, cfg.ha_prefix)
    else:
        store = MetadataStore(cfg.state_dir) if cfg.state_dir else None

    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    zmq_on = bool(cfg.kv_events_endpoint)
    kv_events = KVEventLog(
        medium=cfg.kv_events_medium,
        buffer=cfg.kv_events_buffer,
        queue=cfg.kv_events_queue,
        encode_vllm=zmq_on,
        hashes=cfg.kv_events_hashes,
    )
    # One batch per burst: the first event recorded schedules a flush on the loop, which
    # runs once the call that records it has let go of the loop (usually after the call).
    kv_events.wake = lambda: loop.call_soon_threadsafe(kv_events.flush)

    def on_event(type_: int, key: str, size: int, reason: int, tier: int = 0) -> None:
        # Called with the state lock held, so recording is ordered with the state change.
        block = holder[0].block_of(key) if holder else None
        if reason == pb.KV_EVENT_REASON_TIER:  # a copy moved: the stream says which tier
            if type_ == pb.KV_EVENT_STORED:
                kv_events.tier_added(key, block, tier)
            else:
                kv_events.tier_dropped(key, block, tier)
            return
        tiers = holder[0].tiers_of(key) if holder else []
        if type_ == pb.KV_EVENT_STORED:
            kv_events.stored(key, block, tiers)
        else:  # the object being removed still tells its block (its engine hashes)
            kv_events.removed(key, block, tiers)
        args = (type_, key, size, reason, int(telemetry.now_ms()))
        if threading.get_ident() == loop_thread:
            hub.publish(*args)
        else:  # a control-wire thread: the hub's subscribers wake on the loop
            loop.call_soon_threadsafe(hub.publish, *args)

    holder: list[MasterState] = []  # on_event may run while the state loads
    state = MasterState(cfg, store=store, on_event=on_event)
    holder.append(state)
    handlers = MasterHandlers(state)
    collector = _StateCollector(state, hub, handlers.lock, kv_events)
    telemetry.REGISTRY.register(collector)
    wire = None
    if cfg.wire_port >= 0:
        wire = WireServer(handlers, cfg.host, cfg.wire_port)
        handlers.wire_port = wire.port
        if cfg.ha_etcd:  # clients dial a list of masters: say which host this one is
            handlers.wire_host = advertised(cfg, wire.port).rpartition(":")[0].strip("[]")
    server = await grpcutil.start_server(
        [
            (
                kvstore_pb2_grpc.add_KVMasterServiceServicer_to_server,
                KVMasterServicer(handlers, hub, kv_events),
                "pdserve.v1.KVMasterService",
            )
        ],
        f"{cfg.host}:{cfg.port}",
    )
    zmq_pub = None
    if zmq_on:
        zmq_pub = ZmqPublisher(
            kv_events, cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic
        )
    kv_events.flush()  # batch 0: AllBlocksCleared (and what loading the state dir stored)
    metrics_port = telemetry.serve_metrics(cfg.metrics_port, cfg.host)
    address = advertised(cfg, server.port)
    log.info(
        "kvstore master serving on %s, control wire port %s (state_dir=%r)",
        address,
        handlers.wire_port or "off",
        cfg.state_dir,
    )
    from pdserve.discovery import leave, register_service
    from pdserve.v1 import common_pb2, meta_pb2

    meta_client = await register_service(
        cfg.meta,
        meta_pb2.Instance(
            instance_id="kvstore-master",
            role=common_pb2.ROLE_KVSTORE_MASTER,
            address=address,
            labels={"metrics": advertised(cfg, metrics_port)} if metrics_port else {},
        ),
    )
    announce_ready(
        "kvstore-master",
        grpc=address,
        metrics=metrics_port,
        wire=handlers.wire_port,
        kv_events=zmq_pub.endpoint if zmq_pub else "",
        kv_events_replay=zmq_pub.replay_endpoint if zmq_pub else "",
    )

    def tick() -> None:
        with handlers.lock:
            state.tick()

    async def housekeeping() -> None:
        # Off the event loop, like every call: the pass may commit to SQLite.
        while True:
            await asyncio.sleep(cfg.tick_interval_ms / 1000)
            try:
                await asyncio.to_thread(tick)
            except Exception:  # keep the master up; the next tick retries
                log.exception("housekeeping pass failed")

    task = asyncio.create_task(housekeeping())
    # Re-replication: the target's node copies from a source node; the master only asks.
    # Moves between a node's tiers run through the same loop (the node copies locally).
    repair_loop = RepairLoop(handlers, cfg.max_repairs_per_tick)
    repairer = None
    if cfg.max_repairs_per_tick > 0 or cfg.max_tier_moves_per_tick > 0:
        repairer = asyncio.create_task(repair_loop.run(cfg.tick_interval_ms / 1000))
    try:
        await stop.wait()
    finally:
        log.info("kvstore master draining")
        await leave(meta_client)
        task.cancel()
        if repairer is not None:
            repairer.cancel()
        await repair_loop.close()
        hub.close()
        kv_events.close()
        if zmq_pub is not None:
            await zmq_pub.close()
        if wire is not None:
            wire.close()
        await server.stop(grace=2.0)
        with handlers.lock:
            state.flush()
        if store is not None:
            store.close()
        if leadership is not None:  # at once: a standby need not wait for the lease to end
            leadership.resign()
            leadership.link.close()
        telemetry.REGISTRY.unregister(collector)
