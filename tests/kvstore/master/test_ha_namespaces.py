"""The HA master's etcd rows carry the namespaces too (services/kvstore/master/ha.py, a real
etcd): an object's chain root, the namespace rows (with their tenant), the quarantines and
the tenants' pins written by a leader read back as a successor loads them, and a drop's, a
clear's and an unpin's deletions stick."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from etcd_harness import run_etcd

from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.master.ha import EtcdLink, EtcdMetadataStore, Leadership
from pdserve.services.kvstore.master.persistence import (
    NamespaceChanges,
    StoredNamespace,
    StoredObject,
    StoredPin,
    StoredQuarantine,
    StoredReplica,
)

FP, SALTED, OTHER = "a" * 64, "c" * 64, "b" * 64


@pytest.mark.slow
def test_namespaces_and_quarantines_round_trip_through_etcd(tmp_path: Path) -> None:
    for endpoint in run_etcd(tmp_path):
        cfg = MasterConfig(ha_etcd=[endpoint], port=1)
        link = EtcdLink(cfg.etcd_access())
        try:
            leader = Leadership(link, cfg.ha_prefix, "127.0.0.1:1", 5, on_lost=lambda _w: None)
            asyncio.run(leader.campaign(progress=lambda _m: None))
            store = EtcdMetadataStore(link, leader, cfg.ha_prefix)
            obj = StoredObject("k", 10, False, 0, (StoredReplica("s", "n", 64),), b"\x01", SALTED)
            labels = {"fingerprint": FP, "model_id": "org/a"}
            changes = NamespaceChanges(
                namespaces={
                    FP: StoredNamespace(FP, FP, labels),
                    SALTED: StoredNamespace(SALTED, FP, labels, "acme"),  # a tenant's root
                    OTHER: StoredNamespace(OTHER, OTHER, {}),
                },
                quarantines={OTHER: StoredQuarantine(OTHER, "diverged", "router:r1", 7)},
                pins={("acme", "sys/prompt"): StoredPin("acme", "sys/prompt", ("k",), 9)},
            )
            store.apply([obj], [], changes)
            assert store.load() == [obj]
            spaces, quarantines = store.load_namespaces()
            assert sorted(spaces, key=lambda n: n.root) == [
                StoredNamespace(FP, FP, labels),
                StoredNamespace(OTHER, OTHER, {}),
                StoredNamespace(SALTED, FP, labels, "acme"),
            ]
            assert quarantines == [StoredQuarantine(OTHER, "diverged", "router:r1", 7)]
            assert store.load_pins() == [StoredPin("acme", "sys/prompt", ("k",), 9)]
            # a drop of FP's roots and a cleared quarantine
            store.apply(
                [],
                ["k"],
                NamespaceChanges(
                    dropped={FP, SALTED},
                    quarantines={OTHER: None},
                    pins={("acme", "sys/prompt"): None},
                ),
            )
            assert store.load_pins() == []
            assert store.load() == []
            assert store.load_namespaces() == ([StoredNamespace(OTHER, OTHER, {})], [])
            leader.resign()
        finally:
            link.close()
