"""How long ``pdserve bench chaos`` takes to recover from a store fault, in the two figures a
user of the store feels (issue 56):

- ``store_s``: from the fault until prompts are served from the store again, and stay so: the
  end of the first answer (of a request sent after the fault) from which on every answer is
  token-exact and says that part of its prompt came from the store
  (``usage.prompt_tokens_details.cached_tokens`` > 0: with the torch engine, which keeps no
  prefix cache of its own, those tokens were loaded from the store). Every scored prompt
  shares a stored prefix, so before the fault every answer loads some.
- ``restart_s`` (a killed service): from the SIGKILL until ``up`` has it running again and
  ready (its READY line), as its supervisor records it.

With ``--kvstore-masters 2`` (or more) the ``master`` and ``stall`` faults hit the master that
leads at that moment (the one whose gRPC health passes: a standby binds nothing).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
#: Statuses a client retries (the service is busy or briefly without a worker).
RETRIABLE = {429, 502, 503, 504}


class Answer(Protocol):
    start: float
    end: float
    prompt: int
    status: int
    text: str
    cached: int


def score(row: Any, outcomes: Sequence[Answer], refs: Sequence[str], t_fault: float) -> None:
    """Counts ``outcomes`` into the chaos row ``row`` (exact, wrong, hung, retriable, failed)
    and sets its ``recovery_s``: from the fault to the start of the first request after which
    every request sent after the fault succeeded token-exact."""
    for o in outcomes:
        row.requests += 1
        if o.status == 200:
            if o.text == refs[o.prompt]:
                row.exact += 1
            else:
                row.wrong += 1
        elif o.status == 0:
            row.hung += 1
        elif o.status in RETRIABLE:
            row.retriable += 1
        else:
            row.failed += 1
    after = sorted((o for o in outcomes if o.start >= t_fault), key=lambda o: o.start)
    ok_from = None
    for o in after:
        good = o.status == 200 and o.text == refs[o.prompt]
        if not good:
            ok_from = None
        elif ok_from is None:
            ok_from = o
    if ok_from is not None:
        row.recovery_s = round(max(0.0, ok_from.start - t_fault), 2)


def store_served_s(outcomes: Sequence[Answer], refs: Sequence[str], t_fault: float) -> float | None:
    """Seconds from ``t_fault`` to the end of the first answer from which on (by end time)
    every answer to a request sent after the fault is right and loaded part of its prompt
    from the store (None: the last one did not). Requests sent before the fault are left out:
    a stalled one ending late says nothing about when the store served again."""
    after = sorted((o for o in outcomes if o.start >= t_fault and o.prompt >= 0), key=_end)
    served_from = None
    for o in after:
        if o.status == 200 and o.text == refs[o.prompt] and o.cached > 0:
            served_from = served_from or o
        else:
            served_from = None
    return None if served_from is None else round(max(0.0, served_from.end - t_fault), 2)


def _end(o: Answer) -> float:
    return o.end


def leader(addresses: Sequence[str], timeout_s: float = 1.0) -> str | None:
    """The address of the master that serves (leads) among ``addresses``, or None."""
    from pdserve import grpcutil

    async def serving() -> list[bool]:
        return list(await asyncio.gather(*(grpcutil.check_health(a, timeout_s) for a in addresses)))

    up = [a for a, ok in zip(addresses, asyncio.run(serving()), strict=True) if ok]
    return up[0] if len(up) == 1 else None


def master_victim(cluster: Any, masters: dict[str, str]) -> str:
    """The service name of the master to fault: the only one, or the one leading now."""
    if len(masters) == 1:
        return next(iter(masters))
    deadline = time.monotonic() + 30.0
    while (address := leader(list(masters.values()))) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no single KV master leads among {list(masters.values())}")
        time.sleep(0.1)
    return next(name for name, a in masters.items() if a == address)


def retry(fn: Callable[..., T], *args: Any, timeout_s: float = 60.0) -> T:
    """``fn(*args)``, again while the store answers UNAVAILABLE or DEADLINE_EXCEEDED (a call
    that found the master it tried dead or standing by: the client tries the next one) until
    ``timeout_s`` has passed."""
    from pdserve import errors

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn(*args)
        except (errors.Unavailable, errors.DeadlineExceeded):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds``, then SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_restarted(cluster: Any, name: str, restarts: int, timeout_s: float = 180.0) -> float:
    """Waits until ``up``'s supervisor has ``name`` running after its ``restarts``-th restart;
    returns the monotonic time it saw that (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup = cluster.supervised[name]
        if sup.restarts >= restarts and sup.state == "running":
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"{name} did not come back within {timeout_s:.0f}s")


def port_runs(lengths: tuple[int, ...], avoid: set[int]) -> list[int]:
    """The first port of a run of free consecutive ports for each of ``lengths`` (the masters
    listen on master_port + i, up's etcd on etcd_port and etcd_port + 1), none in ``avoid``."""
    from pdserve.procs import free_ports

    out: list[int] = []
    taken = set(avoid)
    while len(out) < len(lengths):
        n = lengths[len(out)]
        first = free_ports(1)[0]
        run = set(range(first, first + n))
        if first + n <= 65535 and not run & taken and _free(run):
            out.append(first)
            taken |= run
    return out


def _free(ports: set[int]) -> bool:
    import socket

    socks = []
    try:
        for port in sorted(ports):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
