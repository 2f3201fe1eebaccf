"""One table per proto enum, taken from its descriptor (protos/pdserve/v1/*.proto): a value's
name as config, flags, logs, metrics and ``pdserve status`` spell it, and back.

The spelling is the proto name without the enum's prefix, lower case (``ROLE_KVSTORE_MASTER``
-> ``kvstore-master`` for roles, whose words are joined by ``-`` as the service commands are;
``DISAGG_MODE_COLOCATED`` -> ``colocated``). ``UNSPECIFIED`` (0) is ``"unspecified"`` in the
table but not among :attr:`ProtoEnum.choices`, the names a user may give. Tables that map an
enum to another vocabulary (OpenAI's finish reasons, mTLS identities) are not spellings of the
enum and stay with their users.
"""

from __future__ import annotations

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from pdserve.v1 import common_pb2, kvstore_pb2, router_pb2


class ProtoEnum:
    """The names of one proto enum: ``names`` (value -> spelling), ``values`` (spelling ->
    value), ``proto_names`` (value -> the proto's own name); ``specified`` (every value but
    UNSPECIFIED, in order) and their spellings, ``choices``."""

    def __init__(self, enum: EnumTypeWrapper, prefix: str, sep: str = "_") -> None:
        self.proto = enum
        self.proto_names: dict[int, str] = {
            v.number: v.name for v in enum.DESCRIPTOR.values if v.name.startswith(prefix)
        }
        assert len(self.proto_names) == len(enum.DESCRIPTOR.values), f"{prefix}: a value lacks it"
        self.names: dict[int, str] = {
            n: name.removeprefix(prefix).lower().replace("_", sep)
            for n, name in self.proto_names.items()
        }
        self.values: dict[str, int] = {name: n for n, name in self.names.items()}
        self.specified: tuple[int, ...] = tuple(sorted(n for n in self.names if n))
        self.choices: tuple[str, ...] = tuple(self.names[n] for n in self.specified)

    def name(self, value: int) -> str:
        """The spelling of ``value``; the number itself when the enum has no such value (a
        newer peer's)."""
        return self.names.get(value, str(value))

    def value(self, name: str) -> int:
        """The value spelled ``name`` (one of :attr:`choices`, or ``"unspecified"``);
        ValueError naming the choices otherwise."""
        try:
            return self.values[name]
        except KeyError:
            raise ValueError(f"{name!r} is not one of {', '.join(self.choices)}") from None


#: A service's role (common.proto ``Role``): router, prefill, decode, kvstore-master, ...
ROLE = ProtoEnum(common_pb2.Role, "ROLE_", sep="-")
#: How the router serves a request (router.proto ``DisaggMode``): read, write, colocated.
DISAGG_MODE = ProtoEnum(router_pb2.DisaggMode, "DISAGG_MODE_")
#: A data-plane transport (kvstore.proto ``Transport``): shm, tcp, mooncake.
TRANSPORT = ProtoEnum(kvstore_pb2.Transport, "TRANSPORT_")
#: Where a KV store segment's bytes live (kvstore.proto ``StorageTier``): memory, disk.
STORAGE_TIER = ProtoEnum(kvstore_pb2.StorageTier, "STORAGE_TIER_")
#: Why a generation ended (common.proto ``FinishReason``): length, eos, stop, cancelled.
FINISH_REASON = ProtoEnum(common_pb2.FinishReason, "FINISH_REASON_")
#: Who wrote a chat message (router.proto ``ChatRole``): system, user, assistant, developer, tool.
CHAT_ROLE = ProtoEnum(router_pb2.ChatRole, "CHAT_ROLE_")
