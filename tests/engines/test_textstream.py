from __future__ import annotations

from collections.abc import Sequence

from pdserve.engines.textstream import TextStream


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level 'tokenizer': each id is one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, data: bytes) -> list[str]:
    return [stream.add(b) for b in data]


def test_multibyte_characters_are_never_split() -> None:
    text = "a€b🙂c"
    s = TextStream(byte_decode)
    pieces = feed(s, text.encode())
    pieces.append(s.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the euro sign (3 bytes) comes out whole, on its last byte
    assert pieces[1:4] == ["", "", "€"]


def test_stop_string_truncates_and_is_not_emitted() -> None:
    s = TextStream(byte_decode, stop=["END"])
    pieces = feed(s, b"hello ENDworld")
    assert "".join(pieces) == "hello "
    assert s.stopped
    assert s.add(ord("x")) == "" and s.flush() == ""


def test_partial_stop_prefix_is_held_then_released() -> None:
    s = TextStream(byte_decode, stop=["END"])
    pieces = feed(s, b"xEN")
    assert "".join(pieces) == "x"  # "EN" may start "END": held
    pieces.append(s.add(ord("d")))
    assert "".join(pieces) == "xENd"
    assert not s.stopped
    assert s.flush() == ""


def test_flush_releases_held_prefix_at_the_end() -> None:
    s = TextStream(byte_decode, stop=["STOP"])
    assert "".join(feed(s, b"abST")) == "ab"
    assert s.flush() == "ST"
    assert s.text == "abST"


def test_first_completed_stop_string_wins() -> None:
    # "cd" completes (at "d") before "bcde" could: generation stops there
    s = TextStream(byte_decode, stop=["cd", "bcde"])
    out = "".join(feed(s, b"abcdef"))
    assert out == "ab"
    assert s.stopped
    s = TextStream(byte_decode, stop=["xcd", "bc"])
    assert "".join(feed(s, b"abcd")) == "a"


def test_stop_string_spanning_multibyte_token() -> None:
    s = TextStream(byte_decode, stop=["€!"])
    out = "".join(feed(s, "ok€!more".encode()))
    assert out == "ok"
    assert s.stopped


def test_context_merging_matches_full_decode() -> None:
    # a decoder whose output for a token depends on the previous one (like a leading-space
    # merge): id 1 = "a", id 2 = " b" but "b" right after a 2
    def decode(ids: Sequence[int]) -> str:
        out = ""
        prev = None
        for i in ids:
            out += "a" if i == 1 else ("b" if prev == 2 else " b")
            prev = i
        return out

    ids = [1, 2, 2, 1, 2]
    s = TextStream(decode)
    text = "".join(s.add(i) for i in ids) + s.flush()
    assert text == decode(ids)


def test_min_tokens_counts_only_stop_strings_ending_after_that_many_tokens() -> None:
    """vLLM's min_tokens: a stop string that ends within the first min_tokens tokens' text
    does not stop; one that ends after it does, even when it began before."""
    s = TextStream(byte_decode, stop=["ab"], min_tokens=3)
    out = feed(s, b"abxab")
    assert s.stopped and "".join(out) == "abx"
    # begins inside the first 3 tokens, ends after them: a stop at its start
    s = TextStream(byte_decode, stop=["xyz"], min_tokens=3)
    assert "".join(feed(s, b"axyzb")) == "a" and s.stopped
    # ends exactly at the third token: not a stop; flush releases everything
    s = TextStream(byte_decode, stop=["bc"], min_tokens=3)
    out = "".join(feed(s, b"abcd")) + s.flush()
    assert out == "abcd" and not s.stopped
    # without min_tokens the same text stops at once
    s = TextStream(byte_decode, stop=["bc"])
    assert "".join(feed(s, b"abcd")) == "a" and s.stopped
