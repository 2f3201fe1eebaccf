"""A service's Prometheus /metrics port (pdserve/telemetry.py): with a metrics key it answers
401 to a scrape without ``Authorization: Bearer <key>``; and, as protected mode for the gRPC
ports, a metrics port beyond loopback on a cluster with TLS needs the key or an explicit
``metrics_open``, or the service refuses to start."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import config, identity, telemetry
from pdserve.commands import certs
from pdserve.commands.cli import build_parser
from pdserve.config import ConfigError
from pdserve.services.kvstore.master.config import MasterConfig


def _get(port: int, auth: str = "") -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if auth:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def test_a_keyed_metrics_port_answers_only_scrapes_with_the_key() -> None:
    port = telemetry.serve_metrics(0, key="mk-41c9")
    code, body, headers = _get(port)
    assert code == 401 and "missing metrics key" in body and "metrics_key" in body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert _get(port, "Bearer nope")[0] == 401
    assert _get(port, "Basic bWs6bWstNDFjOQ==")[0] == 401
    code, _body, headers = _get(port, "Bearer mk-41c9")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")  # the exposition
    open_port = telemetry.serve_metrics(0, key="")
    assert _get(open_port)[0] == 200


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> identity.TlsFiles:
    d = tmp_path_factory.mktemp("metrics-certs")
    certs.make(d, ["master:kvstore-master"])
    return identity.TlsFiles.load(
        str(d / "ca.crt"), str(d / "kvstore-master.crt"), str(d / "kvstore-master.key")
    )


@pytest.fixture
def process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process-wide TLS and metrics key the checks set, restored afterwards."""
    monkeypatch.setattr(telemetry, "_metrics_key", "")
    prior = identity.tls()
    yield
    identity.configure_files(prior)


def _check(tls: identity.TlsFiles | None, **fields: object) -> str:
    """The metrics key configure_metrics set for a master config of ``fields``."""
    cfg = config.load(MasterConfig, "kvstore_master", env={}, overrides=fields)
    identity.configure_files(tls)
    telemetry.configure_metrics(cfg, "pdserve kvstore master")
    return telemetry._metrics_key


def test_beyond_loopback_with_tls_a_metrics_port_needs_a_key(
    tls_files, process_state, tmp_path: Path
) -> None:
    # loopback, or no TLS: open as before
    assert _check(tls_files, host="127.0.0.1") == ""
    assert _check(None, host="0.0.0.0", insecure=True) == ""  # a plaintext cluster, by choice
    with pytest.raises(ConfigError) as err:
        _check(tls_files, host="0.0.0.0")
    msg = str(err.value)
    assert msg.startswith(
        "pdserve kvstore master's metrics port would listen on '0.0.0.0', reachable from "
        "other hosts, without a metrics key"
    )
    assert "Bind 127.0.0.1" in msg and "--metrics-open" in msg and "credentials_file" in msg
    with pytest.raises(ConfigError):  # --insecure is about TLS, which is on
        _check(tls_files, host="10.0.0.7", insecure=True)
    # the ways out: a key (or its file), the explicit opening, the port off
    assert _check(tls_files, host="10.0.0.7", metrics_key="k1") == "k1"
    (tmp_path / "key").write_text("k2\n")
    assert _check(tls_files, host="10.0.0.7", metrics_key_file=str(tmp_path / "key")) == "k2"
    assert _check(tls_files, host="10.0.0.7", metrics_open=True) == ""
    assert _check(tls_files, host="10.0.0.7", metrics_port=-1) == ""
    with pytest.raises(ConfigError, match="give metrics_key or metrics_key_file"):
        _check(tls_files, metrics_key="a", metrics_key_file="f")


def test_a_service_refuses_to_start_with_an_open_metrics_port_beyond_loopback(
    tls_files, process_state, capsys: pytest.CaptureFixture[str]
) -> None:
    ca, cert, key = tls_files.paths
    argv = ["kvstore", "master", "--host", "0.0.0.0", "--state-dir", ""]
    argv += ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 2  # a config error, before anything listens
    err = capsys.readouterr().err
    assert "pdserve kvstore-master's metrics port would listen on '0.0.0.0'" in err
