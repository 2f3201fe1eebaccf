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

A unary call with a deadline is not sent to one server and left there: while no server
accepts its connection (a killed leader refuses at once, and so does a standby until it has
won the election and listens) it tries each in turn, failing fast, and again every
:data:`RETRY_S`, until one accepts or the deadline passes. So it reaches a new leader within
a reconnect backoff (300 ms, ``grpcutil``) of it listening, and a dead or standing-by server
costs nothing. (Before, such a call waited for its one server's connection, ``wait_for_ready``,
for its whole deadline: 1.5-2 s lost on each dead or standby master it met, measured as 2-3 s
more before chunks were served from the store again after a failover.) A server that did not
answer within a call's deadline (a paused leader) is left out of these tries for
:data:`HUNG_S`, so they wait for the others instead of going back to it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: Call outcomes that move the channel on to the next server.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Pause between two rounds of tries of a call no server accepted yet (seconds): short against
#: the reconnect backoff (100-300 ms), long enough not to spin (one refused try costs ~0.1 ms).
RETRY_S = 0.05
#: How long a server that let a call's deadline pass is left out of other calls' tries while
#: another one may answer (seconds). About the masters' default lease (``ha_lease_s`` 2): a
#: leader paused for a whole call deadline (1.5 s) has lost its lease by then and a standby
#: leads, or it answers again; a false suspicion (a leader that was only slow) costs calls at
#: most this long, never a wrong answer.
HUNG_S = 2.0


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
    """A streaming call with a deadline waits for its server's connection (``wait_for_ready``)
    instead of failing at once while the channel backs off from refused attempts; a call
    without a deadline fails fast (it would wait forever)."""
    if kw.get("timeout") is not None:
        kw.setdefault("wait_for_ready", True)


def unreached(exc: grpc.RpcError) -> bool:
    """The call failed without reaching a server: its channel had no connection (refused,
    or none yet), which gRPC reports, for a call that does not wait for one, as UNAVAILABLE
    "failed to connect to all addresses" (grpcio 1.85). Such a call is safe to send to
    another server; one that failed later (reset mid-call) is not retried."""
    code = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    return code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details


class _Servers:
    """What a process knows of one list of servers, shared by all its channels to that list
    (a worker's store clients, the router's lookups and event stream each have one): which
    server calls go to, and which let a deadline pass lately. One channel's timeout on a
    paused leader spares the others theirs (each used to wait out its own deadline on it:
    measured, clients went on calling a SIGSTOPped leader until it resumed)."""

    def __init__(self, n: int) -> None:
        self.index = 0
        #: until when each server is left out of the tries (it let a deadline pass)
        self.hung_until = [0.0] * n
        self.lock = threading.Lock()


_SHARED: dict[tuple[str, ...], _Servers] = {}
_SHARED_LOCK = threading.Lock()


def _servers(names: list[str]) -> _Servers:
    """This process's :class:`_Servers` of the list ``names``."""
    with _SHARED_LOCK:
        return _SHARED.setdefault(tuple(names), _Servers(len(names)))


class _Switch:
    """Which of the channels calls go to, and which did not answer lately; thread-safe.
    ``servers``: that knowledge, shared (default: this switch's own)."""

    def __init__(
        self,
        names: list[str],
        channels: list[Any],
        clock: Callable[[], float] = time.monotonic,
        servers: _Servers | None = None,
    ) -> None:
        self.names = names
        self.channels = channels
        self.clock = clock
        self.servers = servers or _Servers(len(channels))
        self._lock = self.servers.lock

    @property
    def index(self) -> int:
        return self.servers.index

    @index.setter
    def index(self, value: int) -> None:
        self.servers.index = value

    @property
    def hung_until(self) -> list[float]:
        return self.servers.hung_until

    def current(self) -> tuple[int, Any]:
        with self._lock:
            return self.index, self.channels[self.index]

    def failed(self, index: int, code: grpc.StatusCode, quiet: bool = False) -> None:
        """A call on ``index`` ended with ``code``: the next calls go to the next server (once
        per failure of the current one: late failures of older calls change nothing).
        ``quiet``: a refused try of a call that tries on (logged at debug level only)."""
        if code not in FAILOVER_CODES:
            return
        with self._lock:
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.hung_until[index] = self.clock() + HUNG_S
            if self.index != index:
                return
            self.index = (index + 1) % len(self.channels)
            nxt = self.names[self.index]
        say = log.debug if quiet else log.info
        say("%s answered %s: trying %s", self.names[index], code.name, nxt)

    def answered(self, index: int) -> None:
        """A call on ``index`` got its answer: the next calls go there too."""
        with self._lock:
            moved = self.index != index
            self.index = index
            self.hung_until[index] = 0.0
        if moved:
            log.info("%s answers: calls go there", self.names[index])

    def next_try(self, refused: set[int]) -> tuple[int, Any] | None:
        """Where a call's next try goes: the first server from the current one on that did
        not refuse this call (``refused``) and did not let a deadline pass lately (unless
        all did: then any); None when every candidate refused (wait, then try again)."""
        with self._lock:
            n, now = len(self.channels), self.clock()
            order = [(self.index + k) % n for k in range(n)]
            live = [i for i in order if self.hung_until[i] <= now] or order
            i = next((i for i in live if i not in refused), None)
            return None if i is None else (i, self.channels[i])


class _Tries:
    """One unary call's tries across the servers until one accepts it or its deadline passes
    (see the module docstring); ``attempt()`` tells what to do after each."""

    def __init__(self, switch: _Switch, timeout: float) -> None:
        self.switch = switch
        self.deadline = switch.clock() + timeout
        self.refused: set[int] = set()
        self.last: grpc.RpcError | None = None

    def target(self) -> tuple[int, Any] | None:
        """The next try's (index, channel), or None: pause :data:`RETRY_S` first."""
        pick = self.switch.next_try(self.refused)
        if pick is None:
            self.refused.clear()
        return pick

    def left(self) -> float:
        return self.deadline - self.switch.clock()

    def failed(self, index: int, exc: grpc.RpcError) -> None:
        """Records a failed try; raises ``exc`` unless another try may succeed in time."""
        refused = unreached(exc)
        self.switch.failed(index, exc.code(), quiet=refused)  # type: ignore[attr-defined]
        if not refused or self.left() <= RETRY_S:
            raise exc
        self.refused.add(index)
        self.last = exc

    def out_of_time(self) -> None:
        """Raises the last refusal when no time is left for a pause and another round."""
        if self.left() <= RETRY_S and self.last is not None:
            raise self.last


class _SyncCallable:
    def __init__(self, switch: _Switch, kind: str, method: str, kwargs: dict) -> None:
        self.switch, self.kind, self.method, self.kwargs = switch, kind, method, kwargs

    def _target(self) -> tuple[int, Callable]:
        index, channel = self.switch.current()
        return index, getattr(channel, self.kind)(self.method, **self.kwargs)

    def __call__(self, request: Any, **kw: Any) -> Any:
        if self.kind == "unary_unary" and kw.get("timeout") is not None:
            return self._tried(request, kw)
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

    def _tried(self, request: Any, kw: dict[str, Any]) -> Any:
        tries = _Tries(self.switch, kw.pop("timeout"))
        kw["wait_for_ready"] = False  # a server without a connection: try the next at once
        while True:
            pick = tries.target()
            if pick is None:
                tries.out_of_time()
                time.sleep(RETRY_S)
                continue
            index, channel = pick
            call = channel.unary_unary(self.method, **self.kwargs)
            try:
                result = call(request, timeout=max(tries.left(), 0.001), **kw)
            except grpc.RpcError as exc:
                tries.failed(index, exc)
                continue
            self.switch.answered(index)
            return result

    def _watched(self, index: int, stream: Iterator) -> Iterator:
        try:
            yield from stream
        except grpc.RpcError as exc:
            self.switch.failed(index, exc.code())  # type: ignore[attr-defined]
            raise


class _AioCallable:
    """Returns the server's own call object (awaitable or iterable as ever); when it ends with
    a failover code the channel moves on. A unary call with a deadline returns an awaitable
    that makes its tries (see the module docstring)."""

    def __init__(self, switch: _Switch, kind: str, method: str, kwargs: dict) -> None:
        self.switch, self.kind, self.method, self.kwargs = switch, kind, method, kwargs

    def __call__(self, request: Any, **kw: Any) -> Any:
        if self.kind == "unary_unary" and kw.get("timeout") is not None:
            return self._tried(request, kw)
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

    async def _tried(self, request: Any, kw: dict[str, Any]) -> Any:
        tries = _Tries(self.switch, kw.pop("timeout"))
        kw["wait_for_ready"] = False
        while True:
            pick = tries.target()
            if pick is None:
                tries.out_of_time()
                await asyncio.sleep(RETRY_S)
                continue
            index, channel = pick
            call = channel.unary_unary(self.method, **self.kwargs)
            try:
                result = await call(request, timeout=max(tries.left(), 0.001), **kw)
            except grpc.RpcError as exc:
                tries.failed(index, exc)
                continue
            self.switch.answered(index)
            return result


class _FailoverChannel:
    """What both kinds of channel share: the switch and the multicallables a stub asks for."""

    _callable: type

    def __init__(self, names: list[str], make: Callable[[str], Any]) -> None:
        self._switch = _Switch(names, [make(n) for n in names], servers=_servers(names))

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
