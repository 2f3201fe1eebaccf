"""Where the threads of a same-host transfer run: both ends of a loopback stream on one CPU.

On loopback the sender's ``sendmsg`` copies a payload into socket buffers and the receiver's
``recv`` copies it out; the kernel hands the bytes over on the sender's CPU. When the two
threads of a stream share a CPU, the receiver copies out of that CPU's cache what the sender
just copied in, and every wake-up between them stays on it. On two CPUs each wake-up is an
inter-processor interrupt (in a VM, an exit), and the bytes cross caches.

A transfer split over parallel streams (:data:`~pdserve.store.transports.tcp.FLAG_STREAM`)
wants each stream's two ends on one CPU and the streams on different CPUs. The scheduler
rarely gets there by itself: threads that run in bursts of 50-100 us look cache-hot, and
the other CPU's idle slices are too short to pull work, so a bad placement sticks. Measured
on loopback (2 vCPUs, Zen 4 KVM guest, 16 x 1 MiB read over two streams, p50 of 32 reads,
three stores of three rounds each): each stream's ends pinned to one CPU 2.27-2.39 ms
(2.44-2.87 in one store); to different CPUs 3.40-3.61 ms; left to the scheduler 2.50-3.24
ms, single reads up to 5 ms (docs/benchmarks.md, "Where the idle time was").

So a node serves a stream request from a client on its own host on the CPU the request came
from (``SO_INCOMING_CPU``: on loopback, the client thread's CPU when it sent it), and the
client's own threads are left alone (it may be an engine's). One stream alone is not moved:
on one CPU its two copies run in turn instead of side by side (1 MiB gets: 297-318 us p50 on
one CPU, 254-261 on two).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

#: Linux has both calls; elsewhere a follower does nothing.
SUPPORTED = hasattr(os, "sched_setaffinity") and hasattr(socket, "SO_INCOMING_CPU")


def same_host(sock: socket.socket) -> bool:
    """True when the peer of a connected ``sock`` is this host: both ends have one address
    (loopback, or this host's own address, which the kernel routes over loopback too)."""
    try:
        return sock.getpeername()[0] == sock.getsockname()[0]
    except OSError:
        return False


class CpuFollower:
    """Moves the thread that serves one connection onto the CPU its peer's stream requests
    come from, and back to the thread's own CPUs for other requests. A no-op unless
    ``enabled``, the platform has the calls, the peer is on this host and the thread may run
    on more than one CPU. Call :meth:`request` on the serving thread, once per request."""

    __slots__ = ("_allowed", "_pinned", "_sock", "active")

    def __init__(self, sock: socket.socket, enabled: bool = True) -> None:
        self._sock = sock
        self._allowed: set[int] = set()
        self._pinned = -1  # the CPU the thread is held on; -1: its own CPUs
        self.active = enabled and SUPPORTED and same_host(sock)
        if self.active:
            self._allowed = os.sched_getaffinity(0)
            self.active = len(self._allowed) > 1

    def request(self, stream: bool) -> None:
        """Before serving a request: ``stream`` (one of a transfer's parallel streams) holds
        the thread on the CPU the request arrived on; otherwise it gets its CPUs back."""
        if not self.active:
            return
        cpu = -1
        try:
            if stream:
                cpu = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_INCOMING_CPU)
                if cpu not in self._allowed:
                    cpu = -1
            if cpu != self._pinned:
                os.sched_setaffinity(0, self._allowed if cpu < 0 else {cpu})
                self._pinned = cpu
        except OSError as exc:
            log.debug("cannot place the thread of a same-host stream (%s); leaving it", exc)
            self.active = False
