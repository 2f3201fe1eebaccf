"""Incremental detokenization and stop strings, shared by the engines.

:class:`TextStream` turns generated token ids into text pieces that are safe to stream:

- never a broken UTF-8 character: while the decoded text ends in U+FFFD (an incomplete
  multi-byte sequence) nothing new is released;
- never text that may still turn out to be the start of a stop string: the longest suffix that
  is a prefix of some stop string is held back until it is decided;
- on a stop string, the text up to (not including) it is released and :attr:`stopped` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"


class TextStream:
    """Feed token ids with :meth:`add`; each call returns the newly releasable text. Call
    :meth:`flush` at the end to release text held back for a stop string that never came.

    ``decode(ids)`` must turn a list of token ids into text. With ``min_tokens`` (vLLM's), a
    stop string counts only when it ends after the text of the first ``min_tokens`` tokens.
    """

    #: Tokens re-decoded before the newest ones so that merges across token boundaries (e.g. a
    #: leading space) come out as in a full decode.
    _CONTEXT = 6

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        *,
        min_tokens: int = 0,
    ) -> None:
        self._decode = decode
        self._min_tokens = min_tokens
        # where a stop string may end after (characters of _text); None until min_tokens are in
        self._floor: int | None = 0 if min_tokens <= 0 else None
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        # text of _ids[:_read], fixed for good; the tokens after _read are not yet decoded
        # into complete characters
        self._text = ""
        self._prefix = 0  # ids before this are never re-decoded
        self._read = 0  # ids before this are in _text
        self._released = 0  # characters of _text already returned
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._released]

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text it releases ("" while undecided or after a stop)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if full.endswith(_INCOMPLETE) or len(full) < len(prefix_text):
            return ""
        self._text += full[len(prefix_text) :]
        self._read = len(self._ids)
        if self._floor is None and self._read >= self._min_tokens:
            self._floor = len(self._text)
        self._prefix = max(self._prefix, self._read - self._CONTEXT)
        return self._release(final=False)

    def flush(self) -> str:
        """Releases what was held back (call when generation ends without a stop)."""
        if self.stopped:
            return ""
        if self._read < len(self._ids):
            # an incomplete character at the very end: release what the decoder makes of it
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self._text += self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        start = self._released
        if self._stop:
            # a stop string can only begin in the held-back part or overlap its start
            search_from = max(0, start - self._max_stop + 1)
            hits = []
            if self._floor is not None:  # and only one that ends past the min_tokens' text
                hits = [
                    i
                    for s in self._stop
                    if (i := self._text.find(s, max(search_from, self._floor - len(s) + 1))) >= 0
                ]
            if hits:
                end = min(hits)
                self.stopped = True
                self._text = self._text[:end]
                self._released = max(start, end)
                return self._text[start : self._released]
            if not final:
                hold = self._held_suffix()
                end = len(self._text) - hold
                if end <= start:
                    return ""
                self._released = end
                return self._text[start:end]
        self._released = len(self._text)
        return self._text[start:]

    def _held_suffix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
