"""The one way pdserve reads a size (segment sizes, buffers, Mooncake's own config keys)."""

from __future__ import annotations

import re
from typing import Any

from pdserve.config_fields import ConfigError

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(value: Any, *, what: str = "size", minimum: int = 1) -> int:
    """Bytes from an int or a number with a unit: ``4096``, ``64MiB``, ``1.5GiB``, ``512MB``.
    Units are binary with or without the ``i`` (``512MB`` = ``512MiB`` = 512 * 2**20), as
    Mooncake reads its sizes, so a value copied from a Mooncake or LMCache config means the
    same here. Raises :class:`ConfigError` (a ValueError) naming ``what`` when the value is
    not a size or is below ``minimum``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int | float):
        n = int(value)
    else:
        m = _SIZE.fullmatch(str(value))
        if not m or (m.group(3) and not m.group(2)):  # "iB" alone is no unit
            raise ConfigError(
                f"{what}: invalid size {value!r}: expected bytes or a number with a unit, e.g. "
                "4096, 64MiB, 512MB or 1.5GiB"
            )
        n = int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))
    if n < minimum:
        raise ConfigError(f"{what}: size must be >= {minimum} bytes, got {value!r}")
    return n
