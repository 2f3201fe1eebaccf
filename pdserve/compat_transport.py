"""Mooncake Transfer Engine settings as this machine can honour them: the metadata server
(``metadata_server`` / ``store_metadata_server``) and the protocol with its RDMA devices
(``protocol`` + ``device_name`` / ``store_protocol`` + ``store_device``). Checked where users
bring Mooncake's keys (:mod:`pdserve.compat`) and where a service picks its store backend
(:class:`pdserve.store.StoreBackendConfig`, ``pdserve up``); each failure is a ConfigError that
says what to set instead."""

from __future__ import annotations

from pathlib import Path

from pdserve.config_fields import ConfigError

#: What a metadata server URL may start with (else it is ``P2PHANDSHAKE``).
METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")
#: Where the kernel lists RDMA devices.
RDMA_SYS = Path("/sys/class/infiniband")


def rdma_devices() -> list[str]:
    """RDMA devices of this machine (``/sys/class/infiniband``)."""
    try:
        return sorted(p.name for p in RDMA_SYS.iterdir())
    except OSError:
        return []


def check_metadata_server(value: str, *, what: str) -> None:
    """Mooncake's ``metadata_server``: ``P2PHANDSHAKE`` or a URL of a metadata service."""
    if value == "P2PHANDSHAKE" or value.startswith(METADATA_SCHEMES):
        return
    raise ConfigError(
        f"{what}: metadata server {value!r} must be P2PHANDSHAKE or a URL starting with "
        f"{', '.join(METADATA_SCHEMES)} (pdserve meta serves http://HOST:PORT/metadata)"
    )


def check_transport(protocol: str, device: str, *, what: str) -> None:
    """Mooncake's ``protocol`` / ``device_name`` pair as this machine can honour it."""
    if protocol not in ("tcp", "rdma"):
        raise ConfigError(f"{what}: protocol must be 'tcp' or 'rdma', got {protocol!r}")
    devices = [d.strip() for d in device.split(",") if d.strip()]
    if protocol == "tcp" and devices:
        raise ConfigError(
            f"{what}: device_name {device!r} names RDMA devices, which protocol 'tcp' does not "
            "use: leave it empty, or set protocol 'rdma'"
        )
    if protocol == "rdma":
        have = rdma_devices()
        if not have:
            raise ConfigError(
                f"{what}: protocol 'rdma' needs an RDMA device and this machine has none "
                f"({RDMA_SYS} is empty or missing): use protocol 'tcp'"
            )
        missing = [d for d in devices if d not in have]
        if missing:
            raise ConfigError(
                f"{what}: device_name {', '.join(missing)}: no such RDMA device here "
                f"(this machine has {', '.join(have)})"
            )
