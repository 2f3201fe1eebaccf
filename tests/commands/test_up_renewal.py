"""`pdserve up` renews its short-lived certificates in place: the cluster serves on past the
first certificates' expiry, each service presents its renewed certificate, and a service
restarted after that joins with the renewed files."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from up_harness import complete, start_up, stop_up

from pdserve import identity


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _served(port: int, admin: identity.TlsFiles) -> int:
    """The serial of the certificate a new TLS handshake with 127.0.0.1:``port`` gets."""
    ctx = identity.client_context(admin)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.slow
def test_up_renews_every_certificate_and_serves_on_past_the_first_ones_expiry(tmp_path: Path):
    """--cert-hours 0.01: certificates live 36 s and are renewed every 18 s. Requests through
    the router succeed token for token for longer than the first certificates lived; every
    certificate file was renewed; the master and meta present their current certificate to a
    new handshake; a decode worker SIGKILLed after the first certificates expired comes back
    (its new connections to meta and the store use the renewed files) and serves; `pdserve
    status` (up's admin certificate, renewed too) reaches every service."""
    proc, _banner, ports, run_dir = start_up(
        tmp_path, "--engine", "torch", "--model", "tiny", "--chunk-size", "16",
        "--segment-size", "64MiB", "--cert-hours", "0.01",
    )  # fmt: skip
    certs = run_dir / "certs"
    leaves = sorted(p for p in certs.glob("*.crt") if p.name != "ca.crt")
    first = {p.name: _cert(p) for p in leaves}
    expiry = max(c.not_valid_after_utc for c in first.values())
    assert expiry - min(c.not_valid_before_utc for c in first.values()) < datetime.timedelta(
        minutes=6
    )  # 36 s after a 5-minute allowance for clock skew
    key = (run_dir / "api_key").read_text().strip()
    prompts = [f"renewal prompt {i} " * 5 for i in range(3)]
    try:
        want = [complete(ports["http"], p, key)["choices"][0]["text"] for p in prompts]
        served = 0
        while datetime.datetime.now(datetime.UTC) < expiry + datetime.timedelta(seconds=20):
            got = [complete(ports["http"], p, key)["choices"][0]["text"] for p in prompts]
            assert got == want
            served += len(got)
            time.sleep(1.0)
        assert served >= 60
        for p in leaves:  # renewed: a new certificate, valid now, for the same identity
            now = _cert(p)
            assert now.serial_number != first[p.name].serial_number, p.name
            assert now.subject == first[p.name].subject
            assert now.not_valid_after_utc > datetime.datetime.now(datetime.UTC)
        admin = identity.TlsFiles.load(
            str(certs / "ca.crt"), str(certs / "admin.crt"), str(certs / "admin.key")
        )
        for name, port in (("kvstore-master", ports["master"]), ("meta", ports["meta"])):
            before = _cert(certs / f"{name}.crt").serial_number
            presented = _served(port, admin)
            after = _cert(certs / f"{name}.crt").serial_number
            assert presented in (before, after), name  # a renewal may fall in between
            assert presented != first[f"{name}.crt"].serial_number, name

        # a worker started now has only the renewed files: meta takes its registration and
        # the router routes to it
        services = {s["name"]: s for s in _services(run_dir)}
        os.kill(services["decode-0"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            now = {s["name"]: s for s in _services(run_dir)}["decode-0"]
            if now["restarts"] == 1 and now["state"] == "running":
                break
            assert time.monotonic() < deadline, f"decode-0 did not come back: {now}"
            time.sleep(0.5)
        got = [complete(ports["http"], p, key)["choices"][0]["text"] for p in prompts]
        assert got == want
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "status", "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and " NO " not in status.stdout, status.stdout
        assert "decode-0" in status.stdout
    finally:
        stop_up(proc)
    said = proc.stderr.read()
    assert said.count(f"renewed {len(leaves)} certificates for 0.01 h") >= 2, said[-3000:]


def _services(run_dir: Path) -> list[dict]:
    import json

    return json.loads((run_dir / "services.json").read_text())["services"]
