"""deploy/k8s: every manifest is valid against the Kubernetes API schemas (offline, strict:
unknown fields fail), the kustomization lists them all, and the pieces fit together: Service
selectors match pods, every ConfigMap and Secret a pod uses exists (the Secrets are made by
secrets.sh, whose `pdserve certs` lines this test runs), each pdserve command line parses with
the ConfigMap's settings, its ports are the container's ports, the Services' and the
Prometheus annotations', its certificate names its role and covers the names peers dial, and
every pod runs as uid 10001, unprivileged, with requests and probes."""

from __future__ import annotations

import copy
import re
import shlex
import socket
import ssl
import threading
from pathlib import Path

import pytest
import yaml
from test_deploy import CONFIGS, ROLES  # one table of service commands for both labs

from pdserve import config
from pdserve.commands.cli import build_parser
from pdserve.identity import Identity, TlsFiles

kv = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (test extra)"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SECRETS_SH = K8S / "secrets.sh"
NAMESPACE = "pdserve"
#: Kubernetes versions the manifests must be valid for: the oldest still common, the newest.
VERSIONS = ["1.30.0", kv.latest_version()]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
#: What the downward API gives the pods, as this test pretends: a pod name per workload, one
#: Kubernetes node (its name and InternalIP).
NODE_NAME, HOST_IP = "k8s-node-1", "10.0.0.7"
CERTS = "/etc/pdserve/certs"
CLUSTER_YAML = "/etc/pdserve/cluster.yaml"


def _kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _documents() -> list[dict]:
    docs = []
    for name in _kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


DOCS = _documents()


def _of(kind: str) -> list[dict]:
    return [d for d in DOCS if d["kind"] == kind]


def _workloads() -> list[dict]:
    return [d for d in DOCS if d["kind"] in WORKLOADS]


def _by_name(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _of(kind)}


def _pdserve_containers() -> list[tuple[dict, dict]]:
    return [
        (w, c)
        for w in _workloads()
        for c in w["spec"]["template"]["spec"]["containers"]
        if c["image"] == "pdserve"
    ]


# --- schemas --------------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest():
    listed = _kustomization()["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    assert _kustomization()["namespace"] == NAMESPACE
    assert {i["name"] for i in _kustomization()["images"]} == {"pdserve"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_for_the_kubernetes_api(doc, version):
    kv.validate(doc, version, strict=True)


def test_the_validator_rejects_broken_manifests():
    router = copy.deepcopy(_by_name("Deployment")["router"])
    router["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kv.ValidationError):
        kv.validate(router, VERSIONS[0], strict=True)
    typo = copy.deepcopy(_by_name("Deployment")["router"])
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 1}}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, VERSIONS[0], strict=True)
    no_selector = copy.deepcopy(_by_name("StatefulSet")["prefill"])
    del no_selector["spec"]["selector"]
    with pytest.raises(kv.ValidationError):
        kv.validate(no_selector, VERSIONS[0], strict=True)


# --- how the pieces fit ---------------------------------------------------------------------


def _secrets_made() -> dict[str, set[str]]:
    """{secret name: its keys}, as secrets.sh creates them (node certificates: NODE_NAME's)."""
    text = SECRETS_SH.read_text().replace("\\\n", " ").replace("$node_files", "NODE_FILES")
    out = {}
    for line in text.splitlines():
        m = re.match(r"(?:.*\|\s*)?apply_secret\s+(\S+)(.*)$", line.strip())
        if not m:
            continue
        keys = set()
        for arg in shlex.split(m.group(2)):
            if arg == "NODE_FILES":
                keys |= {f"{NODE_NAME}.crt", f"{NODE_NAME}.key"}
            elif arg.startswith("--from-file="):
                spec = arg.removeprefix("--from-file=")
                keys.add(spec.split("=", 1)[0] if "=" in spec else spec.rsplit("/", 1)[-1])
        out[m.group(1)] = keys
    return out


def reference_problems(docs: list[dict], secrets: dict[str, set[str]]) -> list[str]:
    """Service selectors that match no pod, workloads whose selector misses their own pods,
    references to ConfigMaps, Secrets or keys that nobody makes, Service ports that name no
    container port."""
    problems = []
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for w in workloads:
        name, spec = w["metadata"]["name"], w["spec"]
        labels = spec["template"]["metadata"]["labels"]
        if not spec["selector"]["matchLabels"].items() <= labels.items():
            problems.append(f"{name}: its selector does not match its own pods")
        if w["kind"] == "StatefulSet" and spec["serviceName"] not in services:
            problems.append(f"{name}: serviceName {spec['serviceName']} is no Service")
    for name, svc in services.items():
        selector = svc["spec"]["selector"]
        matched = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        if not matched:
            problems.append(f"Service {name}: selector {selector} matches no pod")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in matched:
                cports = [
                    p for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]
                ]
                if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
                    problems.append(
                        f"Service {name}: port {target} is no port of {w['metadata']['name']}"
                    )
                elif any(
                    p.get("name") == target and p["containerPort"] != port["port"] for p in cports
                ):
                    # peers dial service:port with the port the flags name: keep them equal
                    problems.append(f"Service {name}: port {port['port']} maps to another number")
    for w in workloads:
        name, pod = w["metadata"]["name"], w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "configMap" in v:
                cm = configmaps.get(v["configMap"]["name"])
                if cm is None:
                    problems.append(f"{name}: ConfigMap {v['configMap']['name']} does not exist")
            if "secret" in v:
                sname = v["secret"]["secretName"]
                if sname not in secrets:
                    problems.append(f"{name}: Secret {sname} is made by nobody")
                    continue
                for item in v["secret"].get("items", []):
                    if item["key"] not in secrets[sname]:
                        problems.append(f"{name}: Secret {sname} has no key {item['key']}")
        for c in pod["containers"]:
            for mount in c.get("volumeMounts", []):
                v = volumes.get(mount["name"])
                if v is None and mount["name"] in claims:
                    continue
                if v is None:
                    problems.append(f"{name}: mounts unknown volume {mount['name']}")
                elif "subPath" in mount and "configMap" in v:
                    cm = configmaps.get(v["configMap"]["name"], {"data": {}})
                    if mount["subPath"] not in cm["data"]:
                        problems.append(f"{name}: ConfigMap has no {mount['subPath']}")
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], set()):
                    problems.append(
                        f"{name}: Secret {ref['name']} key {ref['key']} is made by nobody"
                    )
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["key"] not in configmaps.get(ref["name"], {"data": {}})["data"]:
                    problems.append(f"{name}: ConfigMap {ref['name']} key {ref['key']} missing")
    return problems


def test_selectors_references_and_service_ports_fit():
    secrets = _secrets_made()
    assert set(secrets) == {
        "pdserve-certs",
        "pdserve-node-certs",
        "pdserve-api-key",
        "pdserve-metrics-key",
    }
    assert reference_problems(DOCS, secrets) == []


def test_the_reference_check_catches_mismatches():
    docs = copy.deepcopy(DOCS)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    by["Service", "meta"]["spec"]["selector"] = {"app.kubernetes.io/name": "mta"}
    by["Service", "router"]["spec"]["ports"][0]["targetPort"] = "grcp"
    vols = by["StatefulSet", "prefill"]["spec"]["template"]["spec"]["volumes"]
    next(v for v in vols if "secret" in v)["secret"]["items"][1]["key"] = "prefil.crt"
    by["Deployment", "router"]["spec"]["template"]["spec"]["containers"][0]["env"][2]["valueFrom"][
        "secretKeyRef"
    ]["name"] = "api-key"
    problems = reference_problems(docs, _secrets_made())
    assert any("Service meta: selector" in p for p in problems), problems
    assert any("Service router: port grcp" in p for p in problems), problems
    assert any("no key prefil.crt" in p for p in problems), problems
    assert any("Secret api-key key" in p for p in problems), problems


# --- the pdserve command lines, certificates and ports --------------------------------------


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _downward(workload: dict, value: str) -> str:
    """``$(VAR)`` expanded as the kubelet would, with this test's downward-API values."""
    values = {
        "POD_NAME": f"{workload['metadata']['name']}-0",
        "NODE_NAME": NODE_NAME,
        "HOST_IP": HOST_IP,
    }
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: values[m.group(1)], value)


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What secrets.sh's `certs` lines write, made by the same command lines."""
    out = tmp_path_factory.mktemp("k8s-certs")
    text = SECRETS_SH.read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    calls = [line for line in lines if line.startswith("certs ")]
    assert len(calls) >= 7, calls
    for line in calls:
        line = line.replace('"$ip"', HOST_IP).replace('"node:$node"', f"node:{NODE_NAME}")
        argv = ["certs", "--out", str(out), *shlex.split(line)[1:]]
        args = build_parser().parse_args(argv)
        assert args.func(args) == 0
    return out


@pytest.fixture(scope="module")
def cluster_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k8s-config") / "cluster.yaml"
    path.write_text(_by_name("ConfigMap")["pdserve-config"]["data"]["cluster.yaml"])
    return path


def _parsed(workload: dict, container: dict, certs: Path, cluster: Path):
    """(command key, config) of a pdserve container, its paths mapped to this test's files."""
    argv = [_downward(workload, a) for a in container["args"]]
    argv = [a.replace(CLUSTER_YAML, str(cluster)).replace(CERTS + "/", f"{certs}/") for a in argv]
    args = build_parser().parse_args(argv)
    key = tuple(argv[:2]) if argv[0] == "kvstore" else (argv[0],)
    cls, section = CONFIGS[key]
    return key, config.from_args(cls, section, args)  # raises ConfigError on any bad value


def _ports(key: tuple[str, ...], cfg) -> dict[str, int]:
    names = ("port", "http_port", "metrics_port", "wire_port", "tcp_port")
    return {n: getattr(cfg, n) for n in names if getattr(cfg, n, -1) > 0}


def _metrics_port(key: tuple[str, ...], cfg) -> int:
    return cfg.http_port if key == ("router",) else cfg.metrics_port


def _handshake(server: TlsFiles, client: TlsFiles, hostname: str) -> bool:
    """Whether a client of the CA, presenting ``client``, accepts ``server`` as ``hostname``
    (Python's ssl, as the KV control wire checks; gRPC matches names the same way)."""
    from pdserve import identity

    sctx, cctx = identity.server_context(server), identity.client_context(client)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        try:
            with sctx.wrap_socket(conn, server_side=True) as s:
                s.recv(1)
        except (OSError, ssl.SSLError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with (
            socket.create_connection(listener.getsockname(), timeout=5) as raw,
            cctx.wrap_socket(raw, server_hostname=hostname),
        ):
            return True
    except ssl.SSLCertVerificationError:
        return False
    finally:
        listener.close()
        t.join(5)


def test_the_handshake_check_refuses_a_name_the_certificate_does_not_cover(certs_dir):
    prefill = TlsFiles.load(*(str(certs_dir / f) for f in ("ca.crt", "prefill.crt", "prefill.key")))
    admin = TlsFiles.load(*(str(certs_dir / f) for f in ("ca.crt", "admin.crt", "admin.key")))
    assert _handshake(prefill, admin, "prefill-3.prefill.pdserve")
    assert not _handshake(prefill, admin, "decode-0.decode.pdserve")
    assert not _handshake(prefill, admin, "prefill-0.prefill")  # a wildcard needs two labels


@pytest.mark.parametrize(
    "workload,container",
    _pdserve_containers(),
    ids=lambda x: x["metadata"]["name"] if "metadata" in x else x["name"],
)
def test_pdserve_command_ports_identity_and_probes(workload, container, certs_dir, cluster_yaml):
    key, cfg = _parsed(workload, container, certs_dir, cluster_yaml)
    name = workload["metadata"]["name"]
    template = workload["spec"]["template"]
    # $(VAR)s name env vars of the container (the kubelet leaves others as they are)
    env_names = [e["name"] for e in container.get("env", [])]
    for value in [*container["args"], *(e.get("value", "") for e in container.get("env", []))]:
        for var in re.findall(r"\$\(([A-Z_]+)\)", value):
            assert var in env_names, f"{name}: $({var}) is not defined"

    # ports: the flags' are the container's, and Prometheus scrapes the metrics one
    ports = _ports(key, cfg)
    assert sorted(ports.values()) == sorted(p["containerPort"] for p in container["ports"]), name
    ann = template["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == _metrics_port(key, cfg) > 0
    assert ann["prometheus.io/path"] == "/metrics"
    metrics = [p for p in container["ports"] if p.get("name") == "metrics"]
    if key != ("router",):
        assert [p["containerPort"] for p in metrics] == [cfg.metrics_port], name

    # mutual TLS with a certificate of the role, mounted from the Secret, covering the names
    files = TlsFiles.load(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    assert files is not None, f"{name} runs without TLS"
    ident = files.identity()
    assert ident.role == ROLES[key], (name, ident)
    if key == ("kvstore", "node"):
        assert ident == Identity("node", cfg.node_id) and cfg.node_id == NODE_NAME
    admin = TlsFiles.load(*(str(certs_dir / f) for f in ("ca.crt", "admin.crt", "admin.key")))
    advertised = cfg.advertise_host or cfg.host
    assert advertised not in ("", "0.0.0.0"), f"{name} advertises no address peers can dial"
    assert _handshake(files, admin, advertised), f"{name}'s certificate does not cover {advertised}"
    assert _handshake(files, admin, "127.0.0.1")  # the probes dial it
    if key != ("kvstore", "node"):  # peers dial Services by name
        assert _handshake(files, admin, name) or name in ("prefill", "decode")

    # the probes: gRPC health with the pod's own certificate, or the router's HTTP /health
    env = {k: _downward(workload, v) for k, v in _env(container).items()}
    probes = [container[p] for p in ("readinessProbe", "livenessProbe") if p in container]
    assert len(probes) == 2, f"{name} needs readiness and liveness probes"
    for probe in [*probes, *([container["startupProbe"]] if "startupProbe" in container else [])]:
        if "httpGet" in probe:
            assert key == ("router",) and probe["httpGet"]["path"] == "/health"
            assert probe["httpGet"]["port"] in ("http", cfg.http_port)
            continue
        cmd = probe["exec"]["command"]
        if cmd[0] == "sh":  # sh -c 'exec pdserve health "$HOST_IP:PORT"'
            cmd = shlex.split(cmd[2].replace("$HOST_IP", HOST_IP))[1:]
        assert cmd[:2] == ["pdserve", "health"], cmd
        build_parser().parse_args(cmd[1:])
        # a standby KV master binds nothing: its probes pass on a closed port, no one else's
        assert ("--standby-ok" in cmd) == (key == ("kvstore", "master")), cmd
        host, port = cmd[2].rsplit(":", 1)
        assert int(port) == cfg.port and host in ("127.0.0.1", cfg.host), cmd
    if key == ("router",):  # its public port takes no client certificate
        assert not any(k.startswith("PDSERVE_TLS_") for k in env)
        refs = [
            e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        ]
        assert any(e["name"] == "PDSERVE_ROUTER_API_KEY" for e in container["env"])
        assert refs == [{"name": "pdserve-api-key", "key": "api-key"}]
    else:
        # its metrics port (beyond loopback, TLS on) takes the key the PodMonitor sends
        (ref,) = [
            e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if e["name"] == f"PDSERVE_{CONFIGS[key][1].upper()}_METRICS_KEY"
        ]
        assert ref == {"name": "pdserve-metrics-key", "key": "metrics-key"}, name
        tls_env = [env[f"PDSERVE_TLS_{k}"] for k in ("CA", "CERT", "KEY")]
        assert [t.replace(CERTS + "/", f"{certs_dir}/") for t in tls_env] == [
            cfg.tls_ca,
            cfg.tls_cert,
            cfg.tls_key,
        ]


def _service_addresses(cfg) -> list[str]:
    """host:port values of a config that name other services (each of a list: HA masters)."""
    out = []
    for field in ("meta", "store_master", "master_address"):
        value = getattr(cfg, field, "")
        if value:
            out += value.split(",")
    out += list(getattr(cfg, "etcd_endpoints", []) or [])
    out += list(getattr(cfg, "ha_etcd", []) or [])
    return out


def test_every_address_a_service_dials_is_a_service_port(certs_dir, cluster_yaml):
    services = {
        name: {p["port"] for p in svc["spec"]["ports"]} for name, svc in _by_name("Service").items()
    }
    headless = {
        n for n, svc in _by_name("Service").items() if svc["spec"].get("clusterIP") == "None"
    }
    seen = set()
    for workload, container in _pdserve_containers():
        _, cfg = _parsed(workload, container, certs_dir, cluster_yaml)
        for address in _service_addresses(cfg):
            host, port = address.rsplit(":", 1)
            pod, _, rest = host.partition(".")
            if rest:  # a StatefulSet pod's DNS name: <pod>.<its headless Service>.<namespace>
                host, _, namespace = rest.partition(".")
                assert namespace == NAMESPACE and host in headless, address
                sts = _by_name("StatefulSet")[host]
                assert sts["spec"]["serviceName"] == host, address
                ordinal = pod.removeprefix(f"{host}-")
                assert ordinal.isdigit() and int(ordinal) < sts["spec"]["replicas"], address
            assert host in services and int(port) in services[host], (workload["metadata"], address)
            seen.add(host)
    assert {"meta", "kvstore-master", "etcd"} <= seen


# --- topology and security ------------------------------------------------------------------


def test_topology():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    assert {
        ("StatefulSet", "etcd"),
        ("Deployment", "meta"),
        ("Service", "meta"),
        ("StatefulSet", "kvstore-master"),
        ("Service", "kvstore-master"),
        ("DaemonSet", "kvstore-node"),
        ("Deployment", "router"),
        ("Service", "router"),
        ("ConfigMap", "pdserve-config"),
    } <= kinds
    # prefill and decode: separate workloads, each with its own replica count
    pools = {
        w["metadata"]["name"]: w
        for w in _workloads()
        if w["metadata"]["name"] in ("prefill", "decode")
    }
    assert set(pools) == {"prefill", "decode"}
    for w in pools.values():
        assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] >= 1
        assert w["spec"]["podManagementPolicy"] == "Parallel"  # scale like a Deployment
    # the storage nodes keep their segments in a memory-backed /dev/shm
    node = _by_name("DaemonSet")["kvstore-node"]["spec"]["template"]["spec"]
    shm = next(v for v in node["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in node["containers"][0]["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm"
    # two KV masters elect a leader through etcd, which keeps the objects' records (no state
    # volume); clients name both pods by their DNS names, which resolve while a pod stands by
    master = _by_name("StatefulSet")["kvstore-master"]
    assert master["spec"]["replicas"] == 2 and "volumeClaimTemplates" not in master["spec"]
    (container,) = master["spec"]["template"]["spec"]["containers"]
    assert {"--ha-etcd=etcd:2379", "--state-dir="} <= set(container["args"])
    assert "--advertise-host=$(POD_NAME).kvstore-master.pdserve" in container["args"]
    cluster = yaml.safe_load(_by_name("ConfigMap")["pdserve-config"]["data"]["cluster.yaml"])
    assert "state_dir" not in cluster["kvstore_master"]
    svc = _by_name("Service")["kvstore-master"]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    pods = ",".join(f"kvstore-master-{i}.kvstore-master.{NAMESPACE}:50051" for i in range(2))
    clients = {
        w["metadata"]["name"]: a.split("=", 1)[1]
        for w, c in _pdserve_containers()
        for a in c["args"]
        if a.startswith(("--store-master=", "--master-address="))
    }
    assert clients == dict.fromkeys(["kvstore-node", "prefill", "decode", "router"], pods)


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_pods_run_unprivileged_with_requests_and_probes(workload):
    pod = workload["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # none of them calls the API server
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["runAsGroup"] == 10001
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    for c in pod["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
        assert "privileged" not in csc and csc.get("runAsUser", 10001) == 10001
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
        assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
    for v in pod.get("volumes", []):
        assert "hostPath" not in v, "no host paths"
        if "secret" in v:  # keys readable by the pod's group only
            assert v["secret"]["defaultMode"] == 0o440


def test_secret_holds_no_ca_key():
    """The CA key signs identities: it stays with the operator, never in the cluster."""
    for name, keys in _secrets_made().items():
        assert "ca.key" not in keys and "admin.key" not in keys, name
