"""ListNamespaces, DropNamespaces and SetQuarantine through the master's handlers (the
messages gRPC and the control wire carry; no network): who may call them, what they answer,
and how a put's KVNamespace reaches the objects."""

from __future__ import annotations

import pytest

from pdserve import errors
from pdserve.identity import Identity
from pdserve.services.kvstore.master.servicer import MasterHandlers
from pdserve.v1 import kvstore_pb2 as pb

KB = 1024
FP_A, FP_B, SALTED = "a" * 64, "b" * 64, "c" * 64
ADMIN = Identity("admin", "ops")
ROUTER = Identity("router", "r1")
WORKER = Identity("worker", "w1")


def _handlers(make_state) -> MasterHandlers:
    h = MasterHandlers(make_state(inline_max_bytes=0))
    h.state.mount("n1-seg0", "n1", 64 * KB, [], address="n1:7000")
    return h


def _put(h: MasterHandlers, keys: list[str], root: str, digest: str) -> None:
    req = pb.BatchPutStartRequest(client_id="c")
    req.namespaces.add(root=root, fingerprint=digest, labels={"model_id": f"m-{digest[0]}"})
    for k in keys:
        req.items.add(key=k, size=KB, namespace=1)
    resp = h.call("BatchPutStart", req, WORKER)
    assert [r.code for r in resp.results] == [pb.KV_OK] * len(keys)
    h.call("BatchPutEnd", pb.BatchKeysRequest(client_id="c", keys=keys), WORKER)


def test_list_and_drop_answer_per_fingerprint_and_root(make_state) -> None:
    h = _handlers(make_state)
    _put(h, ["a0", "a1"], FP_A, FP_A)
    _put(h, ["s0"], SALTED, FP_A)
    _put(h, ["b0"], FP_B, FP_B)
    listed = h.call("ListNamespaces", pb.ListNamespacesRequest(), ADMIN).fingerprints
    assert [(f.fingerprint, f.objects, f.bytes) for f in listed] == [
        (FP_A, 3, 3 * KB),
        (FP_B, 1, KB),
    ]
    assert [(r.root, r.objects) for r in listed[0].roots] == [(FP_A, 2), (SALTED, 1)]
    assert listed[0].labels["model_id"] == "m-a" and not listed[0].quarantined
    dry = h.call("DropNamespaces", pb.DropNamespacesRequest(roots=[SALTED], dry_run=True), ADMIN)
    assert [(f.fingerprint, f.objects) for f in dry.dropped] == [(FP_A, 1)]
    assert h.state.exists(["s0"]) == [True]
    resp = h.call("DropNamespaces", pb.DropNamespacesRequest(fingerprints=[FP_A]), ADMIN)
    assert [(f.fingerprint, f.objects, f.bytes) for f in resp.dropped] == [(FP_A, 3, 3 * KB)]
    assert resp.deferred == 0
    exists = h.call("BatchExists", pb.BatchKeysRequest(keys=["a0", "a1", "s0", "b0"]), WORKER)
    assert list(exists.exists) == [False, False, False, True]
    assert h.call("Stats", pb.StatsRequest(), WORKER).dropped_objects == 3


def test_quarantine_set_by_the_router_cleared_by_admin_only(make_state) -> None:
    h = _handlers(make_state)
    _put(h, ["a0"], FP_A, FP_A)
    q = pb.SetQuarantineRequest(fingerprint=FP_A, quarantined=True, reason="diverged")
    with pytest.raises(errors.PermissionDenied, match="router"):
        h.call("SetQuarantine", q, WORKER)
    resp = h.call("SetQuarantine", q, ROUTER)
    assert not resp.was_quarantined and resp.objects == 1
    prefix = h.call("LongestPrefix", pb.LongestPrefixRequest(keys=["a0"]), WORKER)
    assert prefix.length == 0
    get = h.call("BatchGetReplicaList", pb.BatchGetReplicaListRequest(keys=["a0"]), WORKER)
    assert get.results[0].code == pb.KV_NOT_FOUND
    req = pb.BatchPutStartRequest(client_id="c")
    req.namespaces.add(root=FP_A, fingerprint=FP_A)
    req.items.add(key="a1", size=KB, namespace=1)
    assert h.call("BatchPutStart", req, WORKER).results[0].code == pb.KV_QUARANTINED
    (listed,) = h.call("ListNamespaces", pb.ListNamespacesRequest(), ADMIN).fingerprints
    assert listed.quarantined and listed.quarantine_reason == "diverged"
    assert listed.quarantined_by == "router:r1" and listed.quarantined_ms > 0
    stats = h.call("Stats", pb.StatsRequest(), WORKER)
    assert stats.quarantined_fingerprints == 1 and stats.quarantined_misses == 2
    clear = pb.SetQuarantineRequest(fingerprint=FP_A, quarantined=False)
    with pytest.raises(errors.PermissionDenied, match="admin"):
        h.call("SetQuarantine", clear, ROUTER)
    assert h.call("SetQuarantine", clear, ADMIN).was_quarantined
    assert h.call("LongestPrefix", pb.LongestPrefixRequest(keys=["a0"]), WORKER).length == 1


@pytest.mark.parametrize("who", [WORKER, ROUTER, Identity("node", "n1")])
def test_listing_and_dropping_take_admin(make_state, who: Identity) -> None:
    h = _handlers(make_state)
    with pytest.raises(errors.PermissionDenied, match="admin"):
        h.call("ListNamespaces", pb.ListNamespacesRequest(), who)
    with pytest.raises(errors.PermissionDenied, match="admin"):
        h.call("DropNamespaces", pb.DropNamespacesRequest(fingerprints=[FP_A]), who)


@pytest.mark.parametrize(
    ("method", "request_", "words"),
    [
        ("DropNamespaces", pb.DropNamespacesRequest(), "at least one"),
        ("DropNamespaces", pb.DropNamespacesRequest(fingerprints=["zz"]), "fingerprints[0]"),
        ("DropNamespaces", pb.DropNamespacesRequest(roots=["A" * 64]), "roots[0]"),
        ("SetQuarantine", pb.SetQuarantineRequest(fingerprint="a", quarantined=True), "64"),
        ("SetQuarantine", pb.SetQuarantineRequest(fingerprint=FP_A, quarantined=True), "reason"),
    ],
)
def test_bad_input_is_invalid_argument(make_state, method, request_, words) -> None:
    h = _handlers(make_state)
    with pytest.raises(errors.InvalidArgument) as exc:
        h.call(method, request_, ADMIN)
    assert words in str(exc.value)


def test_a_bad_put_namespace_is_invalid_argument(make_state) -> None:
    h = _handlers(make_state)
    req = pb.BatchPutStartRequest(client_id="c")
    req.namespaces.add(root="not-hex", fingerprint=FP_A)
    req.items.add(key="k", size=KB, namespace=1)
    with pytest.raises(errors.InvalidArgument, match=r"namespaces\[0\].root"):
        h.call("BatchPutStart", req, WORKER)
