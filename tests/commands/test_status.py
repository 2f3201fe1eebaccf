"""``pdserve status`` rendering: workers that registered different KV fingerprints, and those
that serve without the KV store, are named."""

from __future__ import annotations

from pdserve.commands.status import render


def row(iid: str, fingerprint: str) -> dict:
    return {"id": iid, "role": "decode", "address": "127.0.0.1:1", "model": "tiny",
            "healthy": True, "queue": 0, "running": 0, "kv_usage": 0.25,
            "fingerprint": fingerprint}  # fmt: skip


def test_render_names_workers_with_different_kv_fingerprints():
    same = {"meta": "m", "store": None, "instances": [row("d0", "ab" * 32), row("d1", "ab" * 32)]}
    assert "different KV fingerprints" not in render(same)
    assert "25.0%" in render(same)
    mixed = {**same, "instances": [*same["instances"], row("odd", "cd" * 32), row("r", "")]}
    text = render(mixed)
    assert "different KV fingerprints" in text
    assert f"{'ab' * 6}: d0, d1; {'cd' * 6}: odd" in text


def test_render_names_workers_serving_without_the_store():
    on = {**row("d0", "ab" * 32), "kv_store": "on"}
    off = {**row("d1", "ab" * 32), "kv_store": "off: vLLM's KV cache layout cannot be converted"}
    text = render({"meta": "m", "store": None, "instances": [on, off]})
    assert "d1 serves WITHOUT the KV store (off: vLLM's KV cache layout" in text
    assert "d0 serves WITHOUT" not in text
