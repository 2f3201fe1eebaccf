"""``pdserve up``'s supervisor: a service that dies is restarted at once the first time, with
backoff when it keeps dying (no process started: a fake one, and the restart recorded)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from pdserve.commands.up import UpConfig
from pdserve.commands.up_cluster import RESTART_BACKOFF_S, Cluster, Supervised


class _Dead:
    """A service process that has exited (SIGKILL)."""

    name = "kvstore-node-0"
    pid = 4242
    popen = SimpleNamespace(returncode=-9)

    def alive(self) -> bool:
        return False

    def stop(self) -> int:
        return -9

    def log_tail(self, _lines: int) -> str:
        return "(log tail)"


def _cluster(tmp_path: Path, monkeypatch) -> tuple[Cluster, list[str]]:
    cfg = UpConfig(run_dir=str(tmp_path), engine="torch", decode_workers=1)
    cfg.resolve(gpus=[])
    cluster = Cluster(cfg, None)
    cluster.procs = [_Dead()]
    cluster.supervised = {_Dead.name: Supervised(args=["kvstore", "node"])}
    restarted: list[str] = []

    def restart(_index: int, name: str) -> None:  # what _restart leaves behind, nothing started
        sup = cluster.supervised[name]
        sup.restarts += 1
        sup.in_a_row += 1
        sup.started = time.monotonic()
        sup.state = "running"
        restarted.append(name)

    monkeypatch.setattr(cluster, "_restart", restart)
    return cluster, restarted


def _join(cluster: Cluster) -> None:
    for t in cluster.restarts:
        t.join(10)


def test_a_service_that_dies_once_is_restarted_at_once_and_backs_off_when_it_dies_again(
    tmp_path: Path, monkeypatch
) -> None:
    assert RESTART_BACKOFF_S[0] == 0.0
    cluster, restarted = _cluster(tmp_path, monkeypatch)
    sup = cluster.supervised[_Dead.name]
    assert cluster.supervise_once()  # noticed: restarting, due now
    assert sup.state == "restarting" and sup.last_exit == -9
    assert sup.next_start <= time.monotonic()
    assert cluster.supervise_once()  # the next pass starts it
    _join(cluster)
    assert restarted == [_Dead.name] and sup.restarts == 1
    # it died again right away: the next start waits RESTART_BACKOFF_S[1]
    before = time.monotonic()
    assert cluster.supervise_once()
    assert sup.state == "restarting"
    assert sup.next_start >= before + RESTART_BACKOFF_S[1]
    cluster.supervise_once()
    _join(cluster)
    assert restarted == [_Dead.name]  # not yet
