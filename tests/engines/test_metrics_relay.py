"""The metrics relay (pdserve.telemetry): updates made where no /metrics is served (vLLM's
engine core, the KV connector's process) are kept, drained and replayed in the worker's
process."""

from __future__ import annotations

import json

import pytest

from pdserve import telemetry
from pdserve.engines import metrics
from pdserve.store.client.reads import READ_FAILOVERS
from pdserve.telemetry import REGISTRY


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def relay():
    telemetry.start_relay()
    telemetry.drain_relay()
    yield
    telemetry.stop_relay()


def test_relayed_updates_are_kept_in_order_and_applied_here_too(relay) -> None:
    before = _value("pdserve_kv_store_errors_total", op="load")
    metrics.KV_STORE_ERRORS.labels("load").inc()
    metrics.KV_STORE_SECONDS.labels("save").observe(0.25)
    metrics.KV_CHUNKS_SKIPPED.inc(3)
    READ_FAILOVERS.labels("tcp").inc()  # the store client's, in the same process
    got = telemetry.drain_relay()
    assert got == [
        ["kv_store_errors", ["load"], "inc", 1.0],
        ["kv_store_seconds", ["save"], "observe", 0.25],
        ["kv_chunks_skipped", [], "inc", 3],
        ["store_read_failovers", ["tcp"], "inc", 1.0],
    ]
    assert _value("pdserve_kv_store_errors_total", op="load") == before + 1
    assert telemetry.drain_relay() == []  # a drain takes them once
    # They travel in vLLM's msgpack messages: plain lists, strings and numbers.
    assert json.loads(json.dumps(got)) == got


def test_replay_applies_another_processes_updates_once() -> None:
    telemetry.stop_relay()  # as in a worker's process (a connector test may have turned it on)
    updates = [
        ["kv_store_seconds", ["load"], "observe", 0.002],
        ["kv_chunks_written", ["chunk"], "inc", 5],
        ["kv_chunks_written", ["tail"], "inc", 1],
        ["no_such_metric", [], "inc", 1],  # from a newer pdserve: skipped
        ["kv_chunks_written", ["chunk"], "set", 1],  # not an update kind: skipped
        "garbage",
    ]
    count = _value("pdserve_kv_store_op_seconds_count", op="load")
    written = _value("pdserve_kv_chunks_written_total", kind="chunk")
    assert telemetry.replay(updates) == 3
    assert _value("pdserve_kv_store_op_seconds_count", op="load") == count + 1
    assert _value("pdserve_kv_chunks_written_total", kind="chunk") == written + 5
    assert telemetry.drain_relay() == []  # the relay is off here: nothing kept


def test_an_undrained_relay_keeps_only_the_newest(relay, monkeypatch) -> None:
    monkeypatch.setattr(telemetry, "RELAY_MAX", 3)
    for _ in range(5):
        metrics.KV_CHUNKS_WRITTEN.labels("chunk").inc(1)
    metrics.KV_CHUNKS_WRITTEN.labels("tail").inc(1)
    got = telemetry.drain_relay()
    assert len(got) == 3 and got[-1][1] == ["tail"]


def test_two_relayed_metrics_cannot_share_a_name() -> None:
    from prometheus_client import CollectorRegistry, Counter

    with pytest.raises(ValueError, match="exists already"):
        telemetry.Relayed("kv_store_errors", Counter("x_total", "x", registry=CollectorRegistry()))


def test_vllms_own_metrics_are_served_beside_pdserves() -> None:
    """vLLM keeps its metrics (``vllm:*``) in prometheus_client's default registry; pdserve's
    /metrics serves them too, and nothing else of that registry."""
    import prometheus_client
    from prometheus_client import Gauge, generate_latest

    default = prometheus_client.REGISTRY
    gauge = Gauge("vllm:test_requests_waiting", "a vLLM-shaped gauge", ["model_name"])
    try:
        gauge.labels(model_name="tiny").set(4)
        text = generate_latest(REGISTRY).decode()
        assert 'vllm:test_requests_waiting{model_name="tiny"} 4.0' in text
        assert "python_gc_objects_collected_total" in generate_latest(default).decode()
        assert "python_gc_objects_collected_total" not in text
    finally:
        default.unregister(gauge)


def test_a_label_tuple_used_again_updates_the_same_series(relay) -> None:
    """The child of a label tuple is kept after its first use: later updates still land in
    this process's series and in the relay, and other labels stay apart."""
    before = _value("pdserve_store_read_failovers_total", transport="tcp")
    other = _value("pdserve_store_read_failovers_total", transport="shm")
    for _ in range(3):
        READ_FAILOVERS.labels("tcp").inc(2)
    assert READ_FAILOVERS.labels("tcp") is READ_FAILOVERS.labels("tcp")
    assert _value("pdserve_store_read_failovers_total", transport="tcp") == before + 6
    assert _value("pdserve_store_read_failovers_total", transport="shm") == other
    assert telemetry.drain_relay() == [["store_read_failovers", ["tcp"], "inc", 2]] * 3
