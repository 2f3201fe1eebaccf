"""LongestPrefix with its replicas (``with_replicas``): the leading found keys' replica lists,
leased and granted as BatchGetReplicaList gives them, in one walk; and what keeps a location
a reader holds from pointing at reused bytes (a leased object is neither removed nor
evicted). No network."""

from __future__ import annotations

import pytest

from pdserve import errors
from pdserve.identity import Identity
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.services.kvstore.master.state import MasterState
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024


def _put(state: MasterState, key: str, size: int = KB) -> None:
    (r,) = state.put_start("w", [(key, size)])
    assert r.code == pb.KV_OK
    (e,) = state.put_end("w", [key])
    assert e.code == pb.KV_OK


def _handlers(make_state, **cfg) -> MasterHandlers:
    state = make_state(**cfg)
    handlers = MasterHandlers(state)
    endpoint = pb.Endpoint(transport=pb.TRANSPORT_TCP, address="127.0.0.1:1")
    segment = pb.Segment(segment_id="s0", node_id="n0", size=64 * KB, endpoints=[endpoint])
    handlers.MountSegment(pb.MountSegmentRequest(segment=segment, keeps_bytes=True))
    return handlers


def test_prefix_replicas_leases_the_found_keys_and_counts_them(make_state, clock) -> None:
    s = _handlers(make_state).state
    for k in ("h0", "h1", "h3"):
        _put(s, k)
    before = s.stats()
    got = s.prefix_replicas("reader", ["h0", "h1", "h2", "h3"], lease_ms=2000)
    assert [g.key for g in got] == ["h0", "h1"]
    assert all(g.code == pb.KV_OK and g.replicas and g.lease_ms == 2000 for g in got)
    after = s.stats()
    assert after.prefix_queries == before.prefix_queries + 1
    assert after.prefix_hit_keys == before.prefix_hit_keys + 2
    assert (after.gets, after.get_hits) == (before.gets + 2, before.get_hits + 2)
    # The lease is what keeps a reader's location valid: no removal until it ends.
    assert [r.code for r in s.remove(["h0", "h3"])] == [pb.KV_LEASED, pb.KV_OK]
    clock.advance(2.0)
    assert [r.code for r in s.remove(["h0"])] == [pb.KV_OK]
    with pytest.raises(errors.InvalidArgument):
        s.prefix_replicas("reader", ["h1"], lease_ms=s.cfg.max_lease_ms + 1)


def test_a_leased_object_is_not_evicted(make_state, clock) -> None:
    s = _handlers(make_state, high_watermark=1.0, low_watermark=1.0).state
    keys = [f"k{i}" for i in range(4)]
    for k in keys:
        _put(s, k, 16 * KB)  # the segment is full
    s.prefix_replicas("reader", keys, lease_ms=1000)
    (r,) = s.put_start("w", [("new", 16 * KB)])
    assert r.code == pb.KV_NO_SPACE  # every object is leased: nothing to evict
    clock.advance(1.0)
    (r,) = s.put_start("w", [("new", 16 * KB)])
    assert r.code == pb.KV_OK


def test_longest_prefix_answers_replicas_as_batch_get_replica_list(make_state) -> None:
    h = _handlers(make_state)
    for k in ("a", "b"):
        _put(h.state, k)
    plain = h.call("LongestPrefix", pb.LongestPrefixRequest(keys=["a", "b", "x"]))
    assert plain.length == 2 and not plain.results
    req = pb.LongestPrefixRequest(
        keys=["a", "b", "x"], client_id="r", lease_ms=3000, with_replicas=True
    )
    resp = h.call("LongestPrefix", req)
    get = h.call(
        "BatchGetReplicaList", pb.BatchGetReplicaListRequest(client_id="r", keys=["a", "b"])
    )
    assert resp.length == 2
    assert [r.key for r in resp.results] == ["a", "b"]
    for mine, theirs in zip(resp.results, get.results, strict=True):
        assert mine.replicas[0].token  # read grants, data tokens being on
        assert mine.lease_ms == 3000 and theirs.lease_ms == h.state.cfg.default_lease_ms
        assert mine.replicas[0].offset == theirs.replicas[0].offset
        assert mine.checksum == theirs.checksum
    # The same request lease as the get's: the very same results, grants included.
    req.lease_ms = 0
    assert list(h.call("LongestPrefix", req).results) == list(get.results)


def test_replicas_take_a_client_identity(make_state) -> None:
    h = _handlers(make_state)
    _put(h.state, "a")
    node = Identity("node", "n0")
    # The length alone is public state ...
    assert h.call("LongestPrefix", pb.LongestPrefixRequest(keys=["a"]), node).length == 1
    # ... the replicas come with leases and data grants: a client call.
    req = pb.LongestPrefixRequest(keys=["a"], client_id="c", with_replicas=True)
    with pytest.raises(errors.PermissionDenied):
        h.call("LongestPrefix", req, node)
    resp = h.call("LongestPrefix", req, Identity("worker", "w1"))
    assert resp.length == 1 and len(resp.results) == 1
    # The lease is the caller's, scoped like a get's: only w1 releases it.
    assert h.state.objects["a"].leases.keys() == {"w1/c"}
    release = pb.BatchKeysRequest(client_id="c", keys=["a"])
    h.call("BatchReleaseLease", release, Identity("worker", "w2"))
    assert h.state.objects["a"].leases.keys() == {"w1/c"}
    h.call(
        "BatchReleaseLease",
        pb.BatchKeysRequest(client_id="c", keys=["a"]),
        Identity("worker", "w1"),
    )
    assert not h.state.objects["a"].leases
