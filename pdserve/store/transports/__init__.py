"""Data-plane transports: :mod:`.base` (interface), :mod:`.shm`, :mod:`.tcp`, :mod:`.mooncake`."""

from __future__ import annotations

#: Client preference order when the transport is "auto".
PREFERENCE = ("shm", "tcp", "mooncake")
