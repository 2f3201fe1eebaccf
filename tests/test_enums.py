"""The proto enums' one table each (pdserve.enums): every value named and back, the spellings
config, flags, metrics and status show, and the Python mirrors kept in step with the protos."""

from __future__ import annotations

import pytest

from pdserve import enums
from pdserve.requests import Finish
from pdserve.v1 import common_pb2, kvstore_pb2, router_pb2

TABLES = {
    "Role": (enums.ROLE, common_pb2.Role),
    "DisaggMode": (enums.DISAGG_MODE, router_pb2.DisaggMode),
    "Transport": (enums.TRANSPORT, kvstore_pb2.Transport),
    "FinishReason": (enums.FINISH_REASON, common_pb2.FinishReason),
    "ChatRole": (enums.CHAT_ROLE, router_pb2.ChatRole),
}


@pytest.mark.parametrize("name", TABLES)
def test_every_proto_value_has_a_name_and_back(name):
    table, proto = TABLES[name]
    assert set(table.names) == set(proto.values())
    for value in proto.values():
        assert table.value(table.name(value)) == value
        assert table.proto_names[value] == proto.Name(value)
    assert len(set(table.names.values())) == len(table.names)  # no two values share a name
    assert table.choices == tuple(table.names[v] for v in sorted(proto.values()) if v)
    assert table.specified == tuple(v for v in sorted(proto.values()) if v)


def test_the_spellings_users_see():
    """What config files, flags, metrics labels and ``pdserve status`` spell: changing one
    breaks someone's config, so it must be deliberate."""
    assert enums.ROLE.choices == ("router", "prefill", "decode", "kvstore-master", "kvstore-node")
    assert enums.DISAGG_MODE.choices == ("read", "write", "colocated")
    assert enums.TRANSPORT.choices == ("shm", "tcp", "mooncake")
    assert enums.FINISH_REASON.choices == ("length", "eos", "stop", "cancelled")
    assert enums.CHAT_ROLE.choices == ("system", "user", "assistant", "developer", "tool")
    assert enums.ROLE.name(common_pb2.ROLE_KVSTORE_MASTER) == "kvstore-master"


def test_unknown_values_and_names():
    assert enums.ROLE.name(99) == "99"  # a newer peer's role: shown as its number
    with pytest.raises(ValueError, match="read, write, colocated"):
        enums.DISAGG_MODE.value("both")


def test_finish_mirrors_the_proto():
    assert {f.name: int(f) for f in Finish} == {
        enums.FINISH_REASON.names[v].upper(): v for v in enums.FINISH_REASON.specified
    }


def test_transports_spell_their_kind_from_the_table():
    import importlib
    import pkgutil

    from pdserve.store import transports
    from pdserve.store.transports.base import Transport

    for mod in pkgutil.iter_modules(transports.__path__):
        importlib.import_module(f"{transports.__name__}.{mod.name}")
    kinds = {cls.kind: cls.name for cls in Transport.__subclasses__()}
    assert kinds == {v: enums.TRANSPORT.names[v] for v in enums.TRANSPORT.specified}
    assert sorted(transports.PREFERENCE) == sorted(enums.TRANSPORT.choices)
