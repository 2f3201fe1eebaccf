"""Master failover under load: a real cluster (meta, two KV masters electing a leader on a real
etcd, a storage node, prefill and decode torch workers, the router), every client naming both
masters. A steady stream of requests over prompts that share stored prefixes runs while the
leading master is SIGKILLed, then while the new leader is SIGSTOPped past its lease (the killed
one restarted as a standby first, as ``pdserve up`` does). Every request completes token-exact
(0 failed, 0 wrong), no chunk stored before a fault is lost, and decode workers load chunks
from the store again soon after each fault (the figure is printed)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from cluster_harness import CS, Cluster, ids, stream
from etcd_harness import run_etcd

from pdserve.hashing import chunk_keys
from pdserve.model.fingerprint import model_fingerprint
from pdserve.store import open_store
from pdserve.v1 import common_pb2

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
#: prompts: 6 prefixes of 48 tokens (3 chunks) with 4 suffixes each
PROMPTS = [
    [(11 * k + 97 * p) % 500 + 5 for k in range(48)] + [(s * 7 + k) % 500 + 5 for k in range(5)]
    for p in range(6)
    for s in range(4)
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("failover")
    gen = run_etcd(d)
    etcd = next(gen)
    c = Cluster(d, tiny_model_dir, decodes=1, prefills=1, ha_etcd=etcd)
    try:
        yield c
    finally:
        c.close()
        gen.close()


class Load:
    """Requests one after another on a thread, each checked against the expected tokens."""

    def __init__(self, cluster: Cluster, expected: dict[int, list[int]]) -> None:
        self.cluster, self.expected = cluster, expected
        self.done: list[tuple[float, int]] = []  # (end time, prompt index)
        self.failed: list[str] = []
        self.wrong: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            p = i % len(PROMPTS)
            try:
                got = ids(
                    stream(self.cluster, model="tiny", prompt_token_ids=PROMPTS[p], sampling=GREEDY)
                )
            except Exception as exc:  # a failed request: the figure the test asserts on
                self.failed.append(f"{type(exc).__name__}: {exc}")
            else:
                if got != self.expected[p]:
                    self.wrong.append(p)
                self.done.append((time.monotonic(), p))
            i += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)


def _stored_keys(cluster: Cluster) -> list[str]:
    """The keys of every prefix's 3 full chunks (the tiny model's KV in float32)."""
    fp = model_fingerprint(cluster.model_dir, "tiny", "float32", CS)
    return [k for p in PROMPTS[::4] for k in chunk_keys(fp, p[: 3 * CS])]


def _loaded_again_after(cluster: Cluster, t: float) -> float:
    """Seconds from ``t`` to the first request that started after it whose decode worker
    loaded prompt chunks from the store (waits up to 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        later = [
            tr["first_token"] - t
            for tr in cluster.traces().values()
            if tr["admitted"] > t and tr.get("decode_loaded", 0) > 0
        ]
        if later:
            return min(later)
        time.sleep(0.2)
    raise AssertionError("no request loaded chunks from the store after the fault")


def test_master_faults_under_load_lose_nothing(cluster: Cluster, hf_greedy) -> None:
    expected = {p: hf_greedy(PROMPTS[p], 4) for p in range(len(PROMPTS))}
    for p in range(len(PROMPTS)):  # warm: every prefix stored once
        assert (
            ids(stream(cluster, model="tiny", prompt_token_ids=PROMPTS[p], sampling=GREEDY))
            == expected[p]
        )
    keys = _stored_keys(cluster)
    with open_store(cluster.master_address, transport="tcp") as store:
        assert all(store.exists(keys)), "the warm-up stored every prefix"
    leader, standby = cluster.masters
    with Load(cluster, expected) as load:
        time.sleep(2)
        t_kill = time.monotonic()  # as the router's traces (one clock for every process)
        leader.kill()
        time.sleep(8)
        # as up does: the killed one comes back, as a standby now
        cluster.masters[0] = cluster.restart(leader)
        time.sleep(2)
        t_stop = time.monotonic()
        os.killpg(standby.pid, signal.SIGSTOP)
        try:
            time.sleep(8)
        finally:
            os.killpg(standby.pid, signal.SIGCONT)
        time.sleep(4)
    after_kill = _loaded_again_after(cluster, t_kill)
    after_stop = _loaded_again_after(cluster, t_stop)
    print(
        f"\n{len(load.done)} requests, {len(load.failed)} failed, {len(load.wrong)} wrong; "
        f"chunks loaded from the store {after_kill:.2f} s after the SIGKILL, "
        f"{after_stop:.2f} s after the SIGSTOP"
    )
    assert load.failed == [] and load.wrong == []
    assert sum(1 for t, _ in load.done if t > t_kill) > 10
    with open_store(cluster.master_address, transport="tcp") as store:
        lost = [k for k, there in zip(keys, store.exists(keys), strict=True) if not there]
    assert lost == [], f"{len(lost)} of {len(keys)} chunks stored before the faults are gone"
