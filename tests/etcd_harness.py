"""A real etcd for tests: one member on 127.0.0.1 with free ports and a temporary data dir,
killed by its process group afterwards (meta's etcd backend, the KV masters' HA)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_etcd(tmp_path: Path, tls: Path | None = None) -> Iterator[str]:
    """A fresh single-member etcd with a temporary data dir; killed by pid afterwards. With
    ``tls`` (a ``pdserve certs`` folder) clients speak TLS and must present a certificate of
    its CA; the server uses ``etcd.crt``."""
    if not os.path.exists(ETCD):
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    scheme = "https" if tls else "http"
    log = (tmp_path / "etcd.log").open("w")
    args = [
        ETCD,
        "--name",
        "pdserve-test",
        "--data-dir",
        str(tmp_path / "etcd-data"),
        "--listen-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"{scheme}://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"pdserve-test=http://127.0.0.1:{peer}",
    ]
    ctx = None
    if tls:
        args += [f"--cert-file={tls / 'etcd.crt'}", f"--key-file={tls / 'etcd.key'}"]
        args += [f"--trusted-ca-file={tls / 'ca.crt'}", "--client-cert-auth"]
        ctx = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        ctx.load_cert_chain(tls / "etcd.crt", tls / "etcd.key")
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                url = f"{scheme}://127.0.0.1:{client}/health"
                with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("etcd did not start:\n" + (tmp_path / "etcd.log").read_text()[-2000:])
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
