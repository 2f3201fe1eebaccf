"""deploy/k8s/monitoring/podmonitor.yaml (Prometheus Operator): it selects the pod of every
pdserve service and scrapes each on a port that pod names, the one its Prometheus annotations
name, with the metrics key where the port takes one; etcd (no /metrics) is left out."""

from __future__ import annotations

import re

import pytest
import yaml
from test_k8s import K8S, NAMESPACE, _pdserve_containers

PODMONITOR = K8S / "monitoring" / "podmonitor.yaml"


@pytest.fixture(scope="module")
def monitor() -> dict:
    return yaml.safe_load(PODMONITOR.read_text())


def _selected(monitor: dict, labels: dict[str, str]) -> bool:
    sel = monitor["spec"]["selector"]
    if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for expr in sel.get("matchExpressions", []):
        assert expr["operator"] == "In", expr  # the only operator this check understands
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _kept(endpoint: dict, role: str) -> bool:
    """Whether the endpoint's ``keep`` relabelings (on the pod's name label) keep ``role``."""
    for r in endpoint.get("relabelings", []):
        if r.get("action") == "keep":
            assert r["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
            if not re.fullmatch(r["regex"], role):
                return False
    return True


def test_podmonitor_scrapes_every_pdserve_pod_on_its_annotated_port(monitor):
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert all(e["path"] == "/metrics" for e in endpoints)
    scraped = set()
    for workload, container in _pdserve_containers():
        template = workload["spec"]["template"]
        name = workload["metadata"]["name"]
        assert _selected(monitor, template["metadata"]["labels"]), f"{name} is not selected"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        role = template["metadata"]["labels"]["app.kubernetes.io/name"]
        hits = [e["port"] for e in endpoints if e["port"] in ports and _kept(e, role)]
        assert len(hits) == 1, (name, hits)  # one scrape per pod, not two
        annotated = int(template["metadata"]["annotations"]["prometheus.io/port"])
        assert ports[hits[0]] == annotated, name
        scraped.add(name)
    assert scraped >= {"router", "prefill", "decode", "kvstore-master", "kvstore-node", "meta"}
    assert not _selected(monitor, {"app.kubernetes.io/name": "etcd"})


def test_podmonitor_sends_the_metrics_key_to_the_metrics_ports(monitor):
    """Beyond loopback with TLS a metrics port takes a key (pdserve refuses to start it open):
    the endpoint of the `metrics` ports sends the Secret the pods read it from."""
    (endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "metrics"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "pdserve-metrics-key",
        "key": "metrics-key",
    }


def test_podmonitor_labels_series_with_the_role(monitor):
    for e in monitor["spec"]["podMetricsEndpoints"]:
        relabel = e["relabelings"][0]
        assert relabel["targetLabel"] == "pdserve_role"
        assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]


def test_the_selector_check_catches_a_missing_service(monitor):
    broken = yaml.safe_load(PODMONITOR.read_text())
    broken["spec"]["selector"]["matchExpressions"][0]["values"].remove("decode")
    assert not _selected(broken, {"app.kubernetes.io/name": "decode"})
    assert _selected(monitor, {"app.kubernetes.io/name": "decode"})
