"""A standby master's campaign (``services/kvstore/master/ha.py``) against a fake etcd link:
it waits while another master holds the leader key, claims the key once it is free, and an
etcd call that fails does not end it (no network, no etcd)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

from pdserve.errors import Unavailable
from pdserve.services.kvstore.master import ha


class _FakeEtcd:
    """The etcd calls a campaign makes, on a loop of its own as EtcdLink's; ``script`` says
    what each "read the leader" answers: an address (held), None (free) or an exception."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.reads = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.kv = SimpleNamespace(
            get=lambda key: ("get", key),
            txn_compare_create_revision=lambda key, rev: ("free", key, rev),
            txn_op_put=lambda key, value, lease: ("put", key, value, lease),
            txn=lambda compare, ops: ("txn", ops),
        )
        lease = SimpleNamespace(
            grant=lambda ttl: ("grant", ttl),
            revoke=lambda lid: ("revoke", lid),
            keep_alive=lambda lid: self._alive(),
        )
        self.client = SimpleNamespace(lease=lease)

    async def _alive(self):
        while True:
            yield SimpleNamespace(TTL=2)
            await asyncio.sleep(0.05)

    def answer(self, what: str, op: Any) -> Any:
        if what == "read the leader":
            step = self.script[min(self.reads, len(self.script) - 1)]
            self.reads += 1
            if isinstance(step, Exception):
                raise step
            kvs = [SimpleNamespace(value=step.encode())] if step else []
            return SimpleNamespace(kvs=kvs)
        if what == "grant a lease":
            return SimpleNamespace(ID=0xABC, TTL=op[1])
        if what == "campaign":
            return SimpleNamespace(succeeded=True)
        return None

    async def acall(self, what: str, op: Any, timeout: float = 0.0) -> Any:
        return self.answer(what, op)

    def call(self, what: str, op: Any, timeout: float = 0.0) -> Any:
        return self.answer(what, op)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def test_a_standby_waits_while_the_key_is_held_and_campaigns_on_through_etcd_failures(
    monkeypatch,
) -> None:
    monkeypatch.setattr(ha, "POLL_S", 0.001)
    etcd = _FakeEtcd(
        [
            "127.0.0.1:1",  # the leader holds the key
            Unavailable("etcd: read the leader failed: timed out (test)"),
            Unavailable("etcd: read the leader failed: timed out (test)"),
            "127.0.0.1:1",
            None,  # its lease ended: free
        ]
    )
    said: list[str] = []
    leadership = ha.Leadership(etcd, "/t/", "127.0.0.1:2", 2, on_lost=said.append)  # type: ignore[arg-type]
    try:
        asyncio.run(asyncio.wait_for(leadership.campaign(progress=said.append), 10))
        assert etcd.reads == 5
        assert leadership.lease == 0xABC
        assert said == [
            "standby: the kvstore master leader is 127.0.0.1:1",
            "leading (lease abc, 2 s)",
        ]
        leadership.resign()
        assert leadership.lease == 0
    finally:
        etcd.close()
