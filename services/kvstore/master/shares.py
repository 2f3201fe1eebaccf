"""Tenants' shares of the pool as configured (``kvstore_master.tenant_shares``,
``tenant_shares_file``, ``default_tenant_share``; docs/architecture.md, "Tenant shares and
pins"): parsed and checked with errors that name the tenant, without the master's tables (the
config's ``validate`` reads this module; :mod:`.quotas` orders eviction by it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError
from pdserve.services.kvstore.master.namespaces import tenant_problem
from pdserve.sizes import parse_size
from pdserve.v1 import kvstore_pb2 as pb

MEMORY = pb.STORAGE_TIER_MEMORY
DISK = pb.STORAGE_TIER_DISK
#: The tier names a share mapping may use, and their pb.StorageTier.
TIERS = {"memory": MEMORY, "disk": DISK}


@dataclass(frozen=True)
class Share:
    """A tenant's share of one tier: ``fraction`` of the tier's capacity, or ``bytes`` (when
    not 0)."""

    fraction: float = 1.0
    bytes: int = 0

    def of(self, capacity: int) -> int:
        """The share in bytes of a tier of ``capacity`` bytes."""
        return self.bytes if self.bytes else int(self.fraction * capacity)

    @property
    def whole(self) -> bool:
        """The whole tier: no limit."""
        return not self.bytes and self.fraction >= 1.0


def parse_share(value: Any, what: str) -> Share:
    """One tier's share: a number in (0, 1] is a fraction of the tier, an integer above 1 or
    a size with a unit (``512MiB``) is bytes; ConfigError naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a fraction or a size, got {value!r}")
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return Share(bytes=parse_size(value, what=what))
    if not isinstance(number, int | float) or number <= 0:
        raise ConfigError(
            f"{what}: expected a fraction in (0, 1] or a size (bytes, 512MiB), got {value!r}"
        )
    if number <= 1:
        return Share(fraction=float(number))
    if not float(number).is_integer():
        raise ConfigError(f"{what}: {value!r} is above 1, so bytes: it must be a whole number")
    return Share(bytes=int(number))


def parse_tenant_share(value: Any, what: str) -> dict[int, Share]:
    """A tenant's shares by tier: one value for both tiers, or a mapping ``{memory: ...,
    disk: ...}`` (a tier not named: the whole tier)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(TIERS))
        if unknown:
            raise ConfigError(f"{what}: unknown tier {unknown[0]!r}; the tiers are memory, disk")
        return {
            tier: parse_share(value[name], f"{what}.{name}") if name in value else Share()
            for name, tier in TIERS.items()
        }
    share = parse_share(value, what)
    return {MEMORY: share, DISK: share}


class Shares:
    """Every tenant's share of each tier, and the default of the tenants not listed."""

    def __init__(
        self, by_tenant: Mapping[str, dict[int, Share]], default: dict[int, Share]
    ) -> None:
        self.by_tenant = dict(by_tenant)
        self.default = default
        #: Some share is less than its whole tier: eviction orders by usage.
        self.limited = any(
            not s.whole for shares in [default, *self.by_tenant.values()] for s in shares.values()
        )

    @classmethod
    def parse(
        cls, mapping: Mapping[str, Any], default: Any = 1, source: str = "tenant_shares"
    ) -> Shares:
        """The shares of ``mapping`` (tenant -> share, :func:`parse_tenant_share`) with
        ``default`` for the others; ConfigError naming ``source``, the tenant and the problem."""
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{source}: expected a mapping of tenant to share")
        out = {}
        for tenant, value in mapping.items():
            name = str(tenant)
            problem = tenant_problem("tenant", name) if name else "a tenant name is empty"
            if problem:
                raise ConfigError(f"{source}: {problem}")
            out[name] = parse_tenant_share(value, f"{source}[{name!r}]")
        return cls(out, parse_tenant_share(default, "default_tenant_share"))

    @classmethod
    def configured(cls, shares: Mapping[str, Any], shares_file: str, default: Any) -> Shares:
        """The master config's shares: ``shares_file`` (YAML or JSON: a mapping of tenant to
        share) overlaid by ``shares``, with ``default`` for tenants listed in neither."""
        merged: dict[str, Any] = {}
        if shares_file:
            import yaml

            try:
                data = yaml.safe_load(Path(shares_file).expanduser().read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"tenant_shares_file {shares_file!r}: {exc}") from exc
            cls.parse(data, source=f"tenant_shares_file {shares_file!r}")  # its errors name it
            merged.update({str(k): v for k, v in data.items()})
        merged.update(shares)
        return cls.parse(merged, default)

    def of(self, tenant: str, tier: int) -> Share:
        return self.by_tenant.get(tenant, self.default).get(tier, Share())
