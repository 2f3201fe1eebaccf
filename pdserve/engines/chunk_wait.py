"""Write mode's wait for chunks that a parallel prefill is still publishing.

The decode side of the write plan holds the keys of a prompt's leading full chunks before they
exist: the prefill publishing them runs at the same time on another worker. It loads each one
as soon as it is committed, in key order, and gives up on a key that has not landed
``wait_ms`` after the previous one did (the rest of the prompt is then computed, never waited
for forever). Both engines wait with :func:`load_as_landed`, always on a thread of their own,
never on the thread that runs the model: the torch engine on its KV loader threads, the vLLM
connector on its worker-side waiter threads (vLLM's asynchronous KV load), so the other
requests of the worker keep decoding meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

#: Poll interval while a chunk is still being written (seconds): one prefix lookup on the
#: master's control wire (about 0.1 ms) per poll.
POLL_S = 0.005


def load_as_landed(
    store: Any,
    keys: Sequence[str],
    wait_ms: int,
    load: Callable[[int, int], int],
    cancelled: Callable[[], bool] = lambda: False,
) -> int:
    """Calls ``load(start, end)`` for each run ``keys[start:end]`` as soon as the store holds
    it, in order, and returns how many leading keys were loaded. ``load`` returns how many of
    its keys it loaded (fewer: a chunk was missing or corrupt after all, and the wait stops
    there). Waits up to ``wait_ms`` for each next key (0: no wait, load what is there in one
    call); stops early when ``cancelled()``. Store errors propagate."""
    done = 0
    since = time.monotonic()
    while done < len(keys) and not cancelled():
        ready = store.longest_prefix(keys[done:]) if wait_ms > 0 else len(keys)
        if ready:
            got = load(done, done + ready)
            done += got
            if got < ready:
                break
            since = time.monotonic()
            continue
        if (time.monotonic() - since) * 1000.0 >= wait_ms:
            break
        time.sleep(POLL_S)
    return done
