"""Two real Mooncake TransferEngines, in two processes, find each other through pdserve meta's
HTTP metadata endpoint and move bytes (compatibility proof, not a mock)."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.procs import service_args, start_service

pytestmark = pytest.mark.mooncake
PEER = Path(__file__).with_name("te_peer.py")
SIZE = 4 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mooncake_missing() -> str:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"mooncake.engine does not import ({exc}); pip install the mooncake extra"
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_mooncake_missing()), reason=_mooncake_missing() or "mooncake present")
@pytest.mark.parametrize(
    ("backend", "token"),
    [("memory", ""), pytest.param("etcd", "", marks=pytest.mark.etcd), ("memory", "tok-3f9a")],
)
def test_two_transfer_engines_move_bytes_via_meta(
    backend: str, token: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With an http_token the engines write with the token in the metadata URL: the pinned
    Mooncake sends no Authorization header itself, libcurl turns URL credentials into Basic."""
    endpoint = request.getfixturevalue("etcd_endpoint") if backend == "etcd" else None
    token_file = None
    if token:
        token_file = tmp_path / "http-token"
        token_file.write_text(token + "\n")
    args = service_args(
        "meta",
        port=0,
        http_port=0,
        http_metadata=True,
        backend=backend,
        etcd_endpoints=endpoint,
        http_token_file=token_file,
    )
    meta = start_service("meta", args, tmp_path, timeout=60)
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    url = meta.info["http"]
    if token:  # an engine without the token cannot publish itself
        peer = f"127.0.0.1:{free_port()}"
        anon = subprocess.run(
            [sys.executable, str(PEER), "initiator", url, peer, "4096", "7", "nobody", "0"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert "FAIL initialize" in anon.stdout and "http=401" in anon.stderr, anon.stderr[-2000:]
        url = url.replace("http://", f"http://pdserve:{token}@")
    t_name, i_name = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    target = subprocess.Popen(
        [sys.executable, str(PEER), "target", url, t_name, str(SIZE), "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "target.log").open("w"),
        text=True,
        env=env,
    )
    try:
        line = target.stdout.readline()
        assert line.startswith("READY "), line + (tmp_path / "target.log").read_text()[-2000:]
        ptr = line.split()[1]
        init = subprocess.run(
            [sys.executable, str(PEER), "initiator", url, i_name, str(SIZE), "7", t_name, ptr],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert init.stdout.strip().endswith("OK"), init.stdout + init.stderr[-2000:]
        out, _ = target.communicate("check\n", timeout=30)
        expected = hashlib.sha256(random.Random(8).randbytes(SIZE)).hexdigest()
        assert f"SHA {expected}" in out
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
        meta.stop()
