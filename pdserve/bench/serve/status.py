"""How ``pdserve bench serve`` reports progress (:func:`say`, on stderr) and a failure that
ends the run (:class:`BenchError`, with its exit status)."""

from __future__ import annotations

import sys

#: Exit code when the target cannot be reached (or does not serve the model).
EXIT_UNREACHABLE = 2


class BenchError(Exception):
    """A benchmark that cannot go on; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def say(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)
