"""A finding of the fuzz runs, checked without waiting a minute: pdserve's servers must accept
the keepalive pings of pdserve's own clients. gRPC's default allows one ping every 5 minutes
on a connection without calls; our clients ping every 20 s, so the server answered the third
with GOAWAY "too_many_pings" and every idle channel (a fuzz surface between runs, a router's
channel to an idle worker) was dropped after a minute."""

from __future__ import annotations

from pdserve import grpcutil


def test_servers_accept_the_keepalive_pings_of_our_clients() -> None:
    client = dict(grpcutil._options(grpcutil.DEFAULT_MAX_MESSAGE_BYTES))
    server = {**client, **dict(grpcutil._SERVER_OPTIONS)}
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
