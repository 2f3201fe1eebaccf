"""``pdserve kvstore drop``'s choice of fingerprints and a cache salt's chain roots, computed
on the client from the listed labels (the salt never travels; no network)."""

from __future__ import annotations

import dataclasses

from pdserve import hashing
from pdserve.services.kvstore.admin import salt_roots, select
from pdserve.v1 import kvstore_pb2 as pb

A1 = hashing.ModelFingerprint(model_id="org/a", revision="r1", kv_dtype="float32")
A2 = dataclasses.replace(A1, revision="r2")
B = hashing.ModelFingerprint(model_id="org/b", revision="r1", kv_dtype="float32")


def usage(fp: hashing.ModelFingerprint) -> pb.FingerprintUsage:
    return pb.FingerprintUsage(fingerprint=fp.digest().hex(), labels=fp.to_labels())


LISTED = [pb.FingerprintUsage(fingerprint="", objects=3), usage(A1), usage(A2), usage(B)]


def digests(chosen) -> list[str]:
    return [u.fingerprint for u in chosen]


def test_select_by_model_revision_and_digest() -> None:
    a1, a2, b = (f.digest().hex() for f in (A1, A2, B))
    assert digests(select(LISTED, model="org/a")) == [a1, a2]
    assert digests(select(LISTED, model="org/a", revision="r2")) == [a2]
    assert digests(select(LISTED, digests=[b])) == [b]
    assert digests(select(LISTED, model="org/a", revision="r1", digests=[b])) == [a1, b]
    assert select(LISTED, model="org/c") == []
    assert select(LISTED, digests=[""]) == []  # the unknown namespace is never dropped


def test_salt_roots_are_the_chain_roots_the_workers_use() -> None:
    roots = salt_roots([usage(A1), usage(B)], "tenant-1")
    assert roots == [
        hashing.chain_root(A1, "tenant-1").hex(),
        hashing.chain_root(B, "tenant-1").hex(),
    ]
    assert hashing.chain_root(A1, "").hex() not in roots


def test_a_tensor_parallel_ranks_salt_root_is_rank_zeros() -> None:
    rank0 = dataclasses.replace(A1, tp_size=2)
    rank1 = dataclasses.replace(rank0, tp_rank=1)
    roots = salt_roots([usage(rank1)], "s")
    assert hashing.chain_root(rank0, "s").hex() in roots


def test_labels_that_name_no_fingerprint_are_skipped(capsys) -> None:
    bare = pb.FingerprintUsage(fingerprint="d" * 64)  # only a quarantine names it
    assert salt_roots([bare], "s") == []
    assert "skipping dddddddddddddddd" in capsys.readouterr().err
