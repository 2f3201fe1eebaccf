"""A gRPC channel that dials with the process's current certificate.

gRPC fixes a channel's credentials when the channel is made, and a channel reconnects (a
restarted peer, a dropped connection) with them for as long as it lives; once ``pdserve up``
renewed the certificates (:mod:`pdserve.identity`) and the old ones expired, such a channel
could never connect again. :func:`pdserve.grpcutil.channel` and ``sync_channel`` therefore
return, with mutual TLS, a channel that makes a new inner channel from the renewed files the
first time a call follows a renewal. Calls in flight stay on the channel they started on,
which is kept until this one closes (a renewal is hours apart: a channel a renewal).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdserve import identity


class _Current:
    """The inner channel made with the latest files, and the ones made before it."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self.generation = identity.generation()
        self.channel = make()
        self.old: list[Any] = []

    def get(self) -> Any:
        generation = identity.generation()
        if generation != self.generation:
            with self._lock:
                if generation != self.generation:
                    self.old.append(self.channel)
                    self.channel, self.generation = self._make(), generation
        return self.channel

    def all(self) -> list[Any]:
        with self._lock:
            return [*self.old, self.channel]


class _Callable:
    """A multicallable that resolves the inner channel at each call."""

    def __init__(self, current: _Current, kind: str, method: str, kwargs: dict) -> None:
        self._current, self._kind, self._method, self._kwargs = current, kind, method, kwargs
        self._made: tuple[Any, Any] = (None, None)  # (inner channel, its multicallable)

    def _target(self) -> Any:
        channel = self._current.get()
        made_on, call = self._made
        if made_on is not channel:
            call = getattr(channel, self._kind)(self._method, **self._kwargs)
            self._made = (channel, call)
        return call

    def __call__(self, request: Any, **kw: Any) -> Any:
        return self._target()(request, **kw)

    def __getattr__(self, name: str) -> Any:  # future(), with_call() of a sync multicallable
        return getattr(self._target(), name)


class _Reloading:
    def __init__(self, make: Callable[[], Any]) -> None:
        self._current = _Current(make)

    def unary_unary(self, method: str, **kwargs: Any) -> Any:
        return _Callable(self._current, "unary_unary", method, kwargs)

    def unary_stream(self, method: str, **kwargs: Any) -> Any:
        return _Callable(self._current, "unary_stream", method, kwargs)

    def stream_unary(self, method: str, **kwargs: Any) -> Any:
        return _Callable(self._current, "stream_unary", method, kwargs)

    def stream_stream(self, method: str, **kwargs: Any) -> Any:
        return _Callable(self._current, "stream_stream", method, kwargs)


class SyncReloadingChannel(_Reloading):
    """A blocking channel that follows certificate renewals (see the module docstring)."""

    def close(self) -> None:
        for channel in self._current.all():
            channel.close()

    def __enter__(self) -> SyncReloadingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AioReloadingChannel(_Reloading):
    """An asyncio channel that follows certificate renewals (see the module docstring)."""

    async def close(self, grace: float | None = None) -> None:
        for channel in self._current.all():
            await channel.close(grace)

    async def __aenter__(self) -> AioReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
