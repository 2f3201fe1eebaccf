"""One worker identity, bounded instances (issue 56): a security review saw a decode
certificate register a second instance under its own name and take 10 of 20 requests from the
router. Meta's registry (memory backend, no network) holds at most
``max_instances_per_identity_by_role`` live instances of a role per identity: one prefill or
decode instance per worker certificate by default."""

from __future__ import annotations

import asyncio
import re

import pytest
from registry_runner import run_with

from pdserve.config import ConfigError
from pdserve.errors import ResourceExhausted
from pdserve.identity import Identity
from pdserve.services.meta import access
from pdserve.services.meta.backends.memory import MemoryBackend
from pdserve.services.meta.registry import Registry
from pdserve.services.meta.server import MetaConfig
from pdserve.v1 import common_pb2, meta_pb2

DECODE, PREFILL, ROUTER = common_pb2.ROLE_DECODE, common_pb2.ROLE_PREFILL, common_pb2.ROLE_ROUTER
D0, P0 = Identity("worker", "decode-0"), Identity("worker", "prefill-0")
POOL, ADMIN = Identity("worker", "decode"), Identity("admin", "ops")


def inst(iid: str, role: int = DECODE, address: str = "127.0.0.1:9000") -> meta_pb2.Instance:
    return meta_pb2.Instance(instance_id=iid, role=role, address=address, model="m")


def refusal(owner: str, held: str, bound: int = 1) -> str:
    return re.escape(f"{owner} already holds") + f".*{re.escape(held)}.*allows {bound} per identity"


def test_a_worker_holds_one_instance_and_registers_it_again() -> None:
    async def body(reg: Registry) -> None:
        lease, _ = await reg.register(inst("decode-0"), 60_000, D0)
        # the probe: a second instance under the same certificate, its own name's suffix
        with pytest.raises(ResourceExhausted, match=refusal("worker:decode-0", "'decode-0'")):
            await reg.register(inst("decode-0-b", address="127.0.0.1:9001"), 60_000, D0)
        # a restart (or a lost lease) registers the same instance_id again: it replaces it
        again, _ = await reg.register(inst("decode-0", address="127.0.0.1:9002"), 60_000, D0)
        assert again != lease
        await reg.heartbeat(again, common_pb2.Load(running_requests=1), D0)
        assert [(i.instance_id, i.address) for i in await reg.list()] == [
            ("decode-0", "127.0.0.1:9002")
        ]
        # the bound is per role and per identity: other workers are not affected
        await reg.register(inst("prefill-0", PREFILL), 60_000, P0)
        await reg.register(inst("decode-1"), 60_000, Identity("worker", "decode-1"))
        # once it left, the identity may register another id
        await reg.deregister(again, D0)
        await reg.register(inst("decode-0-b"), 60_000, D0)
        assert [i.instance_id for i in await reg.list(DECODE)] == ["decode-0-b", "decode-1"]

    run_with(body)


def test_an_expired_lease_no_longer_counts() -> None:
    async def body(reg: Registry) -> None:
        events = await reg.watch(DECODE)
        await reg.register(inst("decode-0"), 500, D0)  # never renewed
        with pytest.raises(ResourceExhausted):
            await reg.register(inst("decode-0-b"), 60_000, D0)
        left = None
        while left is None or left.type != meta_pb2.INSTANCE_EVENT_LEFT:
            left = await asyncio.wait_for(anext(events), 5.0)
        assert left.instance.instance_id == "decode-0"
        await reg.register(inst("decode-0-b"), 60_000, D0)

    run_with(body)


def test_pool_certificates_admins_and_plaintext_are_not_bounded_per_role() -> None:
    """A pool's shared certificate (worker:decode, every pod of a Kubernetes StatefulSet holds
    it: deploy/k8s/decode.yaml) is the pool; meta cannot tell its pods apart."""

    async def body(reg: Registry) -> None:
        for caller, ids in [
            (POOL, ["decode-a", "decode-b", "decode-c"]),
            (ADMIN, ["decode-x", "decode-y"]),
            (None, ["decode-p", "decode-q"]),  # no TLS: no owner, no bound
        ]:
            for iid in ids:
                await reg.register(inst(iid), 60_000, caller)
        assert len(await reg.list()) == 7

    run_with(body)


def test_the_bound_is_per_role_and_configurable() -> None:
    async def body(reg: Registry) -> None:
        for iid in ("decode-0", "decode-0-b"):
            await reg.register(inst(iid), 60_000, D0)
        with pytest.raises(
            ResourceExhausted, match=refusal("worker:decode-0", "'decode-0', 'decode-0-b'", 2)
        ):
            await reg.register(inst("decode-0-c"), 60_000, D0)
        for iid in ("prefill-0", "prefill-0-b", "prefill-0-c"):  # prefill: 0 = no bound
            await reg.register(inst(iid, PREFILL), 60_000, P0)
        r1 = Identity("router", "r1")
        await reg.register(inst("r1", ROUTER), 60_000, r1)
        with pytest.raises(ResourceExhausted, match=refusal("router:r1", "'r1'")):
            await reg.register(inst("r1-b", ROUTER), 60_000, r1)

    run_with(body, max_instances_per_identity_by_role={"decode": 2, "prefill": 0, "router": 1})


class SlowMemory(MemoryBackend):
    """Registrations take a while, so concurrent ones overlap in the registry."""

    async def register(self, instance, ttl_ms):
        await asyncio.sleep(0.01)
        return await super().register(instance, ttl_ms)


def test_concurrent_registrations_cannot_pass_the_bound() -> None:
    async def body(reg: Registry) -> None:
        calls = [reg.register(inst(f"decode-0-{k}"), 60_000, D0) for k in range(10)]
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert sum(isinstance(g, tuple) for g in got) == 1, got
        assert all(isinstance(g, (tuple, ResourceExhausted)) for g in got)
        assert len(await reg.list()) == 1

    run_with(body, SlowMemory())


@pytest.mark.parametrize(
    ("by_role", "message"),
    [
        ({"decoder": 1}, "unknown role 'decoder'; expected one of router, prefill, decode"),
        ({"decode": -1}, "decode must be a count >= 0"),
        ({"decode": "1"}, "decode must be a count >= 0"),
        ({"decode": True}, "decode must be a count >= 0"),
    ],
)
def test_config_checks_the_bounds(by_role, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        MetaConfig(max_instances_per_identity_by_role=by_role).validate()


def test_config_carries_the_bounds() -> None:
    assert MetaConfig().limits().role_bound(PREFILL) == 1
    assert MetaConfig().limits().role_bound(DECODE) == 1
    assert MetaConfig().limits().role_bound(ROUTER) == 0
    cfg = MetaConfig(max_instances_per_identity_by_role={"decode": 3})
    cfg.validate()
    assert (cfg.limits().role_bound(DECODE), cfg.limits().role_bound(PREFILL)) == (3, 0)


@pytest.mark.parametrize(
    ("owner", "one"),
    [
        ("worker:decode-0", True),
        ("worker:prefill-12", True),
        ("worker:decode", False),  # a pool's shared certificate
        ("worker:prefill", False),
        ("admin:ops", False),
        ("router:router", False),
        ("", False),  # no TLS
    ],
)
def test_which_owners_name_one_worker(owner: str, one: bool) -> None:
    assert access.one_worker(owner) is one
