"""A node-side transport peer for the transport tests, run as its own process:
``python transport_peer.py <transports> <segment bytes>``.

It creates one segment, serves it over the named transports with data tokens off (these
tests are about moving bytes; grants are checked on real nodes, tests/store/test_data_tokens.py),
prints one JSON line with the segment protobuf (hex) and then answers stdin commands, one per
line:
``sum OFF LEN`` -> BLAKE3 hex of the region; ``fill OFF LEN SEED`` -> writes seeded random
bytes there and prints their BLAKE3 hex; ``quit``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import blake3
import numpy as np

from pdserve.store.segment import SegmentMemory, shm_name
from pdserve.v1 import kvstore_pb2


def main() -> None:
    names, size = sys.argv[1].split(","), int(sys.argv[2])
    node_id = f"peer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seg = SegmentMemory.create(f"{node_id}-seg0", shm_name(f"{node_id}-seg0"), size)
    servers = []
    for name in names:
        if name == "shm":
            from pdserve.store.transports.shm import ShmServer

            servers.append(ShmServer())
        elif name == "tcp":
            from pdserve.store.transports.tcp_server import TcpServer

            servers.append(TcpServer())
        else:
            from pdserve.store.transports.mooncake import MooncakeServer

            servers.append(MooncakeServer())
    for s in servers:
        s.start([seg])
        s.set_data_key(seg.segment_id, b"")
    proto = kvstore_pb2.Segment(
        segment_id=seg.segment_id,
        node_id=node_id,
        size=size,
        endpoints=[s.endpoint(seg, "peer-host") for s in servers],
    )
    tcp_port = next((s.port for s in servers if s.name == "tcp"), 0)
    print(
        json.dumps(
            {"segment": proto.SerializeToString().hex(), "tcp_port": tcp_port, "shm_name": seg.name}
        ),
        flush=True,
    )
    view = np.frombuffer(seg.mm, dtype=np.uint8)
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "quit":
                break
            off, n = int(args[0]), int(args[1])
            if cmd == "fill":
                view[off : off + n] = np.random.default_rng(int(args[2])).integers(
                    0, 256, n, dtype=np.uint8
                )
            print(blake3.blake3(view[off : off + n].tobytes()).hexdigest(), flush=True)
    finally:
        for s in servers:
            s.stop()
        seg.unlink()


if __name__ == "__main__":
    main()
