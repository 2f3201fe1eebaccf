"""Tenants: several API keys on one router, each a tenant with its own cache namespace, its own
``cached_tokens``, its own requests to abort and its own limit on requests in flight.

The router's ``tenant_keys_file`` holds one tenant a line, ``NAME KEY [OPTION=VALUE ...]``
(blank lines and ``#`` comments skipped; names ``[A-Za-z0-9][A-Za-z0-9_.-]*``, at most 64
characters; keys at least 16 characters, each used once). The options, each at most once, are
the tenant's flow control (:class:`TenantLimits`; services/router/fair_queue.py and
rate_limit.py), e.g. ``team-a KEY share=2 rps=5 tps=2000``:

- ``share``: its weight in the fair queueing of a saturated router (a number > 0, default 1:
  ``share=2`` is admitted twice as often as a tenant with 1 while both wait);
- ``rps``: requests per second it may start (a number > 0; unset = no limit), bursts of up
  to one second's worth (at least 1);
- ``tps``: prompt tokens per second it may send (> 0; unset = no limit), likewise.
  Past either, RESOURCE_EXHAUSTED / 429 with when to retry (``Retry-After``).

A request's key names its tenant, and the router

- derives the cache salt the workers and the store see from the tenant and the request's own
  ``cache_salt`` (:meth:`Tenants.salt`): a tenant shares cached prefixes with itself only, no
  secret to choose, and ``cached_tokens`` counts its own chunks only (the salt is in every
  chunk key, ``pdserve.hashing``); a tenant's salted requests still form their own chain;
- keys the running requests by tenant, so ``Abort`` (and the HTTP API's cancel on
  disconnect) reaches only the caller's own requests;
- caps each tenant's requests in flight (``tenant_max_inflight``; RESOURCE_EXHAUSTED / 429);
- queues, admits and rate-limits by tenant as its options say.

A single ``api_key`` (no tenants file) is one anonymous tenant: salts pass as given, as before.
With a tenants file, ``api_key`` (if also given) is the tenant ``default``. Both have share 1
and no rate limit.
"""

from __future__ import annotations

import hashlib
import math
import re
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from pathlib import Path

from pdserve.config_fields import ConfigError
from pdserve.errors import ResourceExhausted, did_you_mean

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Shortest tenant key (characters).
MIN_KEY_CHARS = 16
#: The tenant a lone ``api_key`` becomes when a tenants file is also given.
DEFAULT_TENANT = "default"
#: The tenant of the request being handled ("" = the anonymous one): set by the router's key
#: checks (HTTP middleware, gRPC interceptor), read where the request is built.
current: ContextVar[str] = ContextVar("pdserve_tenant", default="")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's flow-control options (the module docstring)."""

    #: Weight in the fair queueing across tenants (> 0).
    share: float = 1.0
    #: Requests per second (0 = no limit).
    rps: float = 0.0
    #: Prompt tokens per second (0 = no limit).
    tps: float = 0.0

    @classmethod
    def parse(cls, options: list[str], where: str) -> TenantLimits:
        """``OPTION=VALUE`` words of a tenants file line; a ConfigError names ``where`` and
        the option at fault."""
        values: dict[str, float] = {}
        for i, word in enumerate(options, 3):
            name, sep, text = word.partition("=")
            if not sep or name not in _OPTIONS:  # never echoed: it may be a stray key
                raise ConfigError(
                    f"{where}: field {i} is not an option; expected 'NAME KEY "
                    f"[{'] ['.join(o + '=N' for o in _OPTIONS)}]'{did_you_mean(name, _OPTIONS)}"
                )
            if name in values:
                raise ConfigError(f"{where}: {name} is given twice")
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{where}: {name} must be a number > 0, got {text[:40]!r}")
            values[name] = value
        return cls(**values)


_OPTIONS = tuple(f.name for f in fields(TenantLimits))
NO_LIMITS = TenantLimits()


@dataclass
class Tenants:
    """API keys by tenant (stored as SHA-256 digests), each tenant's flow-control options, and
    each tenant's requests in flight."""

    by_digest: dict[bytes, str] = field(default_factory=dict)
    max_inflight: int = 0
    inflight: dict[str, int] = field(default_factory=dict)
    #: Options by tenant name; a tenant not here (the anonymous one, ``default``) has none.
    limits: dict[str, TenantLimits] = field(default_factory=dict)

    @classmethod
    def configured(cls, api_key: str, keys_file: str = "", max_inflight: int = 0) -> Tenants:
        """The router's keys: the tenants of ``keys_file`` (and ``api_key`` as ``default``),
        else ``api_key`` alone as the anonymous tenant, else none (an open router)."""
        if keys_file:
            return cls.load(keys_file, api_key, max_inflight)
        return cls({_digest(api_key): ""} if api_key else {}, max_inflight)

    @property
    def open(self) -> bool:
        """No key is configured: every caller is the anonymous tenant."""
        return not self.by_digest

    @classmethod
    def load(cls, path: str, api_key: str = "", max_inflight: int = 0) -> Tenants:
        """The tenants of ``path`` (``NAME KEY [OPTION=VALUE ...]`` lines) plus ``api_key`` as
        ``default``; a ConfigError names the file, the line and what is wrong (never the
        key)."""
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"tenant_keys_file {path!r}: {exc.strerror or exc}") from exc
        entries = [(DEFAULT_TENANT, api_key, "api_key", NO_LIMITS)] if api_key else []
        for n, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            where = f"tenant_keys_file {path!r} line {n}"
            if len(parts) < 2:
                raise ConfigError(f"{where}: expected 'NAME KEY [OPTION=VALUE ...]'")
            entries.append((parts[0], parts[1], where, TenantLimits.parse(parts[2:], where)))
        if not entries:
            raise ConfigError(f"tenant_keys_file {path!r} names no tenant")
        tenants = cls(max_inflight=max_inflight)
        names: set[str] = set()
        for name, key, where, limits in entries:
            if not _NAME.match(name):
                raise ConfigError(
                    f"{where}: tenant name {name[:80]!r} must be 1-64 characters of letters, "
                    "digits, '_', '.', '-', starting with a letter or digit"
                )
            if name in names:
                raise ConfigError(f"{where}: tenant {name!r} is named twice")
            if len(key) < MIN_KEY_CHARS:
                raise ConfigError(
                    f"{where}: tenant {name!r}'s key is shorter than {MIN_KEY_CHARS} characters"
                )
            if _digest(key) in tenants.by_digest:
                raise ConfigError(f"{where}: tenant {name!r}'s key is another tenant's too")
            names.add(name)
            tenants.by_digest[_digest(key)] = name
            if limits != NO_LIMITS:
                tenants.limits[name] = limits
        return tenants

    def limits_of(self, tenant: str) -> TenantLimits:
        """``tenant``'s flow-control options (none set: share 1, no rate limit)."""
        return self.limits.get(tenant, NO_LIMITS)

    @property
    def names(self) -> list[str]:
        """Every tenant's name ("" = the anonymous tenant), sorted: the bounded label values
        of the router's per-tenant metrics."""
        return sorted(set(self.by_digest.values()) | {""})

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key ``key`` is ("" = the anonymous tenant's single key); None for
        no tenant's. A lookup of the key's SHA-256
        digest: its timing depends on the digest, which says nothing usable about a key."""
        return self.by_digest.get(_digest(key))

    @staticmethod
    def salt(tenant: str, cache_salt: str) -> str:
        """The cache salt the cluster sees for ``tenant``'s request with ``cache_salt``: as
        given for the anonymous tenant (""), else hex of a keyed hash of both, which no other
        tenant's request can produce (its own name goes into its hash)."""
        if not tenant:
            return cache_salt
        mixed = hashlib.blake2b(
            cache_salt.encode(), key=tenant.encode(), person=b"pdserve-tenant", digest_size=32
        )
        return mixed.hexdigest()

    @staticmethod
    def abort_key(tenant: str, abort_id: str) -> str:
        """The running-request registry's key of ``tenant``'s ``abort_id``."""
        return f"{tenant}\x00{abort_id}" if tenant else abort_id

    def enter(self, tenant: str) -> None:
        """Counts one more request of ``tenant`` in flight; RESOURCE_EXHAUSTED past its cap."""
        if not tenant:
            return
        now = self.inflight.get(tenant, 0)
        if self.max_inflight and now >= self.max_inflight:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {now} requests in flight, its tenant_max_inflight; "
                "retry when some finish"
            )
        self.inflight[tenant] = now + 1

    def leave(self, tenant: str) -> None:
        if not tenant:
            return
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)
