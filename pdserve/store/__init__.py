"""The KV store client side: :func:`open_store` picks a backend ("pdserve" or "mooncake");
:class:`StoreBackendConfig` is the backend choice every service that reaches the store
carries (prefill, decode and router: ``--store-backend mooncake``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.compat_transport import check_metadata_server, check_transport
from pdserve.config_fields import ConfigError, help_field
from pdserve.sizes import parse_size

if TYPE_CHECKING:
    from pdserve.store.api import StoreBackend

BACKENDS = ("pdserve", "mooncake")


def open_store(master_address: str, *, backend: str = "pdserve", **kwargs: Any) -> StoreBackend:
    """The one way to open a store client (code outside :mod:`pdserve.store` constructs no
    backend class itself); ``kwargs`` go to the backend's constructor:

    * ``backend="pdserve"``: pdserve's own store (:class:`pdserve.store.client.StoreClient`).
      ``master_address`` is the KV store master's gRPC HOST:PORT; ``transport`` ("auto",
      "shm", "tcp", "mooncake"), ``timeout_s`` (one master call or transfer), ``control``
      ("auto": the master's control wire when it has one, or "grpc"), ``put_retries``,
      ``client_id``.
    * ``backend="mooncake"``: a Mooncake Store cluster
      (:class:`pdserve.store.mooncake_backend.MooncakeStoreClient`). ``master_address`` is
      the ``mooncake_master`` HOST:PORT; ``segment_bytes`` (memory contributed, 0 = none),
      ``buffer_bytes``, ``host``, ``metadata_server``, ``protocol``, ``device_name``: what
      :meth:`StoreBackendConfig.mooncake_options` gives."""
    if backend == "pdserve":
        from pdserve.store.client import StoreClient

        return StoreClient(master_address, **kwargs)
    if backend == "mooncake":
        from pdserve.store.mooncake_backend import MooncakeStoreClient

        return MooncakeStoreClient(master_address, **kwargs)
    raise ValueError(f"store backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


@dataclass
class StoreBackendConfig:
    """Which store ``store_master`` is, and how to reach a Mooncake one (the keys of
    Mooncake's own JSON config, ``pdserve.compat``)."""

    store_backend: str = help_field(
        "pdserve",
        "what store_master is: 'pdserve' (pdserve's KV store master) or 'mooncake' (a "
        "mooncake_master: Mooncake's master_server_address)",
    )
    store_metadata_server: str = help_field(
        "P2PHANDSHAKE",
        "store_backend mooncake: the Transfer Engine metadata server (Mooncake's "
        "metadata_server): P2PHANDSHAKE, http://HOST:PORT/metadata (pdserve meta serves it), "
        "etcd://HOST:PORT or redis://HOST:PORT",
    )
    store_protocol: str = help_field(
        "tcp", "store_backend mooncake: Transfer Engine protocol, tcp or rdma (Mooncake's protocol)"
    )
    store_device: str = help_field(
        "", "store_backend mooncake, protocol rdma: RDMA device(s), e.g. mlx5_0 (device_name)"
    )
    store_buffer_size: str = help_field(
        "64MiB",
        "store_backend mooncake: the client's registered transfer buffer (Mooncake's "
        "local_buffer_size; bytes, 512MB or 512MiB, binary units)",
        metavar="SIZE",
    )

    def check_store_backend(self) -> None:
        """ConfigError for a backend choice this machine or backend cannot honour."""
        if self.store_backend not in BACKENDS:
            raise ConfigError(
                f"store_backend must be one of {', '.join(BACKENDS)}, got {self.store_backend!r}"
            )
        parse_size(self.store_buffer_size, what="store_buffer_size", minimum=0)
        if self.store_backend == "mooncake":
            check_metadata_server(self.store_metadata_server, what="store_metadata_server")
            check_transport(self.store_protocol, self.store_device, what="store_protocol")
            return
        # pdserve's own store: its data plane is shm / tcp / a Mooncake Transfer Engine over
        # tcp connected peer to peer, so the Mooncake-only settings must stay at their defaults
        for name, default, why in (
            ("store_metadata_server", "P2PHANDSHAKE", "its Mooncake transport connects peer "
             "to peer, with no metadata server"),
            ("store_protocol", "tcp", "its data plane runs over shared memory and tcp"),
            ("store_device", "", "its data plane does not use RDMA devices"),
        ):  # fmt: skip
            if getattr(self, name) != default:
                raise ConfigError(
                    f"{name} {getattr(self, name)!r} applies to store_backend mooncake; "
                    f"pdserve's own store cannot honour it ({why}): set store_backend "
                    f"mooncake, or leave {name} at {default!r}"
                )

    def mooncake_options(self, segment_size: str = "0") -> dict[str, Any]:
        """``MooncakeStoreClient``'s keyword arguments (JSON-serialisable)."""
        host = getattr(self, "advertise_host", "") or getattr(self, "host", "") or "127.0.0.1"
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return {
            "segment_bytes": parse_size(segment_size, what="store_segment_size", minimum=0),
            "buffer_bytes": parse_size(self.store_buffer_size, what="store_buffer_size", minimum=0),
            "host": host,
            "metadata_server": self.store_metadata_server,
            "protocol": self.store_protocol,
            "device_name": self.store_device,
        }
