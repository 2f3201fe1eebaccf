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


def test_render_shows_each_ha_master_and_which_one_leads():
    masters = [
        {"address": "127.0.0.1:50051", "leading": False},
        {"address": "127.0.0.1:50052", "leading": True},
    ]
    up = {
        "up_pid": 1,
        "services": [],
        "kvstore_masters": {
            "kvstore-master-0": "127.0.0.1:50051",
            "kvstore-master-1": "127.0.0.1:50052",
        },
    }
    text = render(
        {"meta": "m", "store": None, "instances": [], "masters": masters, "supervised": up}
    )
    assert "127.0.0.1:50051 (kvstore-master-0): standby (not serving)" in text
    assert "127.0.0.1:50052 (kvstore-master-1): leading" in text
    assert "KV store: no master leads" in text  # (no Stats here)
    alone = render({"meta": "m", "store": None, "instances": [], "masters": masters[:1]})
    assert "127.0.0.1:50051: standby" in alone


def test_health_standby_ok_passes_only_where_nothing_listens():
    """`pdserve health ADDRESS --standby-ok` (a KV master's probe in its own pod): a closed port
    is a standby, a port that accepts but does not answer SERVING still fails."""
    import socket

    from pdserve.commands.cli import build_parser

    def health(*argv: str) -> int:
        args = build_parser().parse_args(["health", *argv, "--timeout", "0.5"])
        return args.func(args)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert health(closed) == 1
    assert health(closed, "--standby-ok") == 0
    with socket.socket() as mute:  # listens, never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)
        assert health(f"127.0.0.1:{mute.getsockname()[1]}", "--standby-ok") == 1
