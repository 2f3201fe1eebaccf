"""A gRPC channel to a list of servers of which one serves at a time: the KV masters of an HA
setup (``services/kvstore/master/ha.py``), named ``host:port,host:port``.

:func:`pdserve.grpcutil.channel` and ``sync_channel`` return one for such a list. It holds a
channel per address and sends each call to the one it believes leads; a call that ends
UNAVAILABLE (a standby binds nothing: refused at once; a dead leader) or DEADLINE_EXCEEDED (a
paused or cut-off leader) moves it on to the next address, so the caller's next call (its
retry, its next heartbeat) tries there. Why not gRPC's own load balancing over the list:
pick_first reconnects to the first address that accepts TCP, and a SIGSTOPped leader still
accepts TCP (the kernel completes the handshake) but never answers, so a channel stayed on it
for as long as it was paused; keepalive pings did not cut that connection within 8 s here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: Call outcomes that move the channel on to the next server.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def addresses(text: str) -> list[str]:
    """The ``host:port`` entries of a comma-separated list (ValueError naming a bad one)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{text!r}: expected host:port[,host:port...], not {part!r}")
        out.append(part)
    return out


def _wait_with_deadline(kw: dict[str, Any]) -> None:
    """A call with a deadline waits for its server's connection (``wait_for_ready``) instead
    of failing at once while the channel backs off from refused attempts: a standby that
    has just become the leader is reached as soon as it listens, and a dead server still
    costs only the deadline. A call without a deadline fails fast (it would wait forever)."""
    if kw.get("timeout") is not None:
        kw.setdefault("wait_for_ready", True)


class _Switch:
    """Which of the channels calls go to; thread-safe."""

    def __init__(self, names: list[str], channels: list[Any]) -> None:
        self.names = names
        self.channels = channels
        self.index = 0
        self._lock = threading.Lock()

    def current(self) -> tuple[int, Any]:
        with self._lock:
            return self.index, self.channels[self.index]

    def failed(self, index: int, code: grpc.StatusCode) -> None:
        """A call on ``index`` ended with ``code``: the next calls go to the next server (once
        per failure of the current one: late failures of older calls change nothing)."""
        if code not in FAILOVER_CODES:
            return
        with self._lock:
            if self.index != index:
                return
            self.index = (index + 1) % len(self.channels)
            nxt = self.names[self.index]
        log.info("%s answered %s: trying %s", self.names[index], code.name, nxt)


class _SyncCallable:
    def __init__(self, switch: _Switch, kind: str, method: str, kwargs: dict) -> None:
        self.switch, self.kind, self.method, self.kwargs = switch, kind, method, kwargs

    def _target(self) -> tuple[int, Callable]:
        index, channel = self.switch.current()
        return index, getattr(channel, self.kind)(self.method, **self.kwargs)

    def __call__(self, request: Any, **kw: Any) -> Any:
        index, call = self._target()
        _wait_with_deadline(kw)
        try:
            result = call(request, **kw)
        except grpc.RpcError as exc:
            self.switch.failed(index, exc.code())  # type: ignore[attr-defined]
            raise
        if self.kind == "unary_stream":
            return self._watched(index, result)
        return result

    def _watched(self, index: int, stream: Iterator) -> Iterator:
        try:
            yield from stream
        except grpc.RpcError as exc:
            self.switch.failed(index, exc.code())  # type: ignore[attr-defined]
            raise


class _AioCallable:
    """Returns the server's own call object (awaitable or iterable as ever); when it ends with
    a failover code the channel moves on."""

    def __init__(self, switch: _Switch, kind: str, method: str, kwargs: dict) -> None:
        self.switch, self.kind, self.method, self.kwargs = switch, kind, method, kwargs

    def __call__(self, request: Any, **kw: Any) -> Any:
        index, channel = self.switch.current()
        _wait_with_deadline(kw)
        call = getattr(channel, self.kind)(self.method, **self.kwargs)(request, **kw)
        switch = self.switch

        async def check(done: Any) -> None:
            switch.failed(index, await done.code())

        def on_done(done: Any) -> None:
            asyncio.get_running_loop().create_task(check(done))

        call.add_done_callback(on_done)
        return call


class _FailoverChannel:
    """What both kinds of channel share: the switch and the multicallables a stub asks for."""

    _callable: type

    def __init__(self, names: list[str], make: Callable[[str], Any]) -> None:
        self._switch = _Switch(names, [make(n) for n in names])

    def current_failed(self) -> None:
        """The server calls go to now stopped answering on another path (the store's
        control wire): the next calls try the next server."""
        self._switch.failed(self._switch.current()[0], grpc.StatusCode.DEADLINE_EXCEEDED)

    def unary_unary(self, method: str, **kwargs: Any) -> Any:
        return self._callable(self._switch, "unary_unary", method, kwargs)

    def unary_stream(self, method: str, **kwargs: Any) -> Any:
        return self._callable(self._switch, "unary_stream", method, kwargs)

    def stream_unary(self, method: str, **kwargs: Any) -> Any:
        return self._switch.current()[1].stream_unary(method, **kwargs)

    def stream_stream(self, method: str, **kwargs: Any) -> Any:
        return self._switch.current()[1].stream_stream(method, **kwargs)


class SyncFailoverChannel(_FailoverChannel):
    """A blocking channel over several servers (see the module docstring)."""

    _callable = _SyncCallable

    def close(self) -> None:
        for channel in self._switch.channels:
            channel.close()

    def __enter__(self) -> SyncFailoverChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AioFailoverChannel(_FailoverChannel):
    """An asyncio channel over several servers (see the module docstring)."""

    _callable = _AioCallable

    async def close(self, grace: float | None = None) -> None:
        for channel in self._switch.channels:
            await channel.close(grace)

    async def __aenter__(self) -> AioFailoverChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
