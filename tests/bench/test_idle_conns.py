"""``pdserve bench idle-conns``'s pieces that need no server: source addresses, payloads,
percentiles, the report and the descriptor limit (the whole tool runs against real processes
in tests/commands/test_up_idle_conns.py)."""

from __future__ import annotations

import resource

import pytest

from pdserve.bench import idle_conns
from pdserve.commands.cli import build_parser


def test_source_addresses_start_after_the_probes_and_stay_in_loopback():
    assert idle_conns.source_addresses(1) == ["127.0.0.2"]
    many = idle_conns.source_addresses(300)
    assert many[:2] == ["127.0.0.2", "127.0.0.3"] and many[253:255] == ["127.0.0.255", "127.0.1.0"]
    assert len(set(many)) == 300 and "127.0.0.1" not in many
    for bad in (0, 250 * 256 + 1):
        with pytest.raises(ValueError):
            idle_conns.source_addresses(bad)


def test_payloads_stop_short_of_a_request():
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert preface.startswith(idle_conns.PAYLOADS["h2-partial"])
    assert len(idle_conns.PAYLOADS["h2-partial"]) < len(preface)
    settings = idle_conns.PAYLOADS["h2-settings"][len(preface) :]
    assert idle_conns.PAYLOADS["h2-settings"].startswith(preface)
    assert settings == bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # empty SETTINGS, stream 0
    assert b"\r\n\r\n" not in idle_conns.PAYLOADS["http-partial"]
    assert idle_conns.PAYLOADS["none"] == b""


def test_percentiles():
    assert idle_conns.percentiles([])["n"] == 0
    p = idle_conns.percentiles([i / 100 for i in range(1, 101)])
    assert p["n"] == 100 and p["p50"] == pytest.approx(0.505) and p["max"] == 1.0
    assert p["p90"] == pytest.approx(0.91) and p["p99"] == 1.0


def test_report_names_the_slow_probes_and_the_held_connections():
    result = {
        "target": "127.0.0.1:1", "conns": 10, "sources": 2, "send": "none", "tls": False,
        "reopen": True, "probe": "grpc",
        "baseline": idle_conns.percentiles([0.002]) | {"errors": 0},
        "flood": idle_conns.percentiles([0.003, 0.7]) | {"errors": 1},
        "flood_open_max": 10, "flood_opened": 20, "flood_closed_by_server": 10,
        "flood_failed": 0, "errors": ["AioRpcError: x"],
        "timeline": [{"t": 0.0, "phase": "flood", "open": 10, "opened": 10,
                      "closed_by_server": 0, "failed": 0, "server_fds": 26}],
        "probes": [(0.5, 0.003), (1.0, 0.7), (1.5, -1.0)],
    }  # fmt: skip
    text = idle_conns.report(result)
    assert "max 700 ms" in text and "at most 10 open at once" in text
    assert "1.0s: 700 ms" in text and "1.5s: failed" in text and "server_fds" in text


def test_raise_nofile_never_lowers_the_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert idle_conns.raise_nofile(1) == soft


def test_the_command_is_registered():
    args = build_parser("bench").parse_args(
        ["bench", "idle-conns", "--target", "127.0.0.1:1", "--sources", "200", "--tls"]
    )
    assert args.func is idle_conns.run and args.sources == 200 and args.conns == 2000
