"""``pdserve up``'s supervision of its services: how soon a dead one is noticed and restarted,
and each one's record (:meth:`pdserve.commands.up_cluster.Cluster.supervise_once` acts on
them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Seconds before the n-th restart in a row of a service (the last value repeats). The first
#: restart of a service that had run (or the first after it ran for STABLE_S) is at once: the
#: backoff is there to keep a service that dies again and again from spinning, and a single
#: death (a killed storage node) cost a whole second of the restart before (2.6 s measured with
#: `pdserve bench chaos`, issue 56's target 2.5 s); a crash loop still backs off 1 s, 2 s, ...
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
#: A service that ran this long (seconds) starts its backoff over.
STABLE_S = 60.0
#: Seconds between two supervision passes: how late a death may be noticed (0.5 s was up to
#: half a second of every restart). A pass polls each process (waitpid WNOHANG) and writes
#: services.json only when something changed: ten passes a second cost nothing measurable.
SUPERVISE_S = 0.1


@dataclass
class Supervised:
    """One service's supervision record."""

    args: list[str]
    #: environment it starts with besides up's own (a worker's GPU, its home)
    env: dict[str, str] = field(default_factory=dict)
    #: the user id it runs as (isolate_services; None: up's)
    user: int | None = None
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    in_a_row: int = 0
    last_exit: int | None = None
    #: "running", "restarting" (waiting out its backoff) or "starting" (not ready yet).
    state: str = "running"
    #: monotonic time of the next start while restarting.
    next_start: float = 0.0
