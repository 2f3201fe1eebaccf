"""A chunk put says whose KV it carries: ChunkIO sends the fingerprint's labels and each
chunk's chain root, the store client turns them into one KVNamespace per distinct root, and
the namespace calls check their input before they reach the master (no network)."""

from __future__ import annotations

import pytest
import torch
from recording_backend import Recording

from pdserve import errors, hashing
from pdserve.engines.chunk_io import ChunkIO
from pdserve.store.api import ChunkNamespace
from pdserve.store.client import namespaces
from pdserve.store.client.writes import _tag
from pdserve.store.memory import MemoryBackend
from pdserve.v1 import kvstore_pb2

FP = hashing.ModelFingerprint(model_id="m", kv_dtype="float32", chunk_size=4)


def test_chunk_io_names_the_fingerprint_and_each_chunks_root() -> None:
    store = Recording()
    io = ChunkIO(store, FP)
    salted = hashing.chain_root(FP, "tenant-1").hex()
    kv = torch.zeros(2, 2, 3, 4, 8)
    assert io.save([("k0", kv), ("k1", kv)], roots={"k1": salted}) == 2
    (ns,) = store.namespaces
    assert ns is not None
    assert ns.fingerprint == FP.digest().hex() and ns.labels == FP.to_labels()
    assert ns.root_of("k0") == FP.digest().hex() and ns.root_of("k1") == salted


def test_the_put_request_carries_one_namespace_per_root() -> None:
    digest, salted = "a" * 64, "c" * 64
    req = kvstore_pb2.BatchPutStartRequest(client_id="c")
    for k in ("k0", "k1", "k2"):
        req.items.add(key=k, size=1)
    _tag(req, ChunkNamespace(digest, {"model_id": "m"}, {"k1": salted}))
    assert [(n.root, n.fingerprint) for n in req.namespaces] == [(digest, digest), (salted, digest)]
    assert [i.namespace for i in req.items] == [1, 2, 1]
    assert req.namespaces[0].labels["model_id"] == "m"


class NoMaster:
    """A master link that must not be called: the input is refused before."""

    def call(self, method, request):
        raise AssertionError(f"{method} reached the master")


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda m: namespaces.drop_namespaces(m), "fingerprint or a root"),
        (lambda m: namespaces.drop_namespaces(m, ["A" * 64]), "fingerprint must be 64"),
        (lambda m: namespaces.drop_namespaces(m, roots=["ab"]), "root must be 64"),
        (lambda m: namespaces.set_quarantine(m, "xyz", "why"), "fingerprint must be 64"),
        (lambda m: namespaces.set_quarantine(m, "a" * 64, ""), "needs a reason"),
        (lambda m: namespaces.set_quarantine(m, "a" * 64, "x" * 2000), "longer than"),
    ],
)
def test_bad_input_is_refused_before_the_master(call, words) -> None:
    with pytest.raises(errors.InvalidArgument, match=words):
        call(NoMaster())


class Dropping(MemoryBackend):
    """A store whose drop answers as the master would, or refuses as it would a worker."""

    def __init__(self, refuse: bool) -> None:
        super().__init__()
        self.refuse = refuse
        self.asked: list[list[str]] = []

    def drop_namespaces(self, fingerprints=(), roots=(), *, dry_run=False):
        self.asked.append(list(fingerprints))
        if self.refuse:
            raise errors.PermissionDenied("worker:w1 may not call DropNamespaces")
        resp = kvstore_pb2.DropNamespacesResponse()
        resp.dropped.add(fingerprint=fingerprints[0], objects=3)
        return resp


def test_the_connector_reset_drops_through_chunk_io_when_allowed(caplog) -> None:
    digest = FP.digest().hex()
    allowed = Dropping(refuse=False)
    assert ChunkIO(allowed, FP).drop([digest]) is True and allowed.asked == [[digest]]
    refused = Dropping(refuse=True)
    assert ChunkIO(refused, FP).drop([digest]) is False
    assert "may not drop chunks" in caplog.text and "pdserve kvstore drop" in caplog.text
    assert ChunkIO(MemoryBackend(), FP).drop([digest]) is False  # no namespaces there
    assert "keeps no namespaces" in caplog.text
