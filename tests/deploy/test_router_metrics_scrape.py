"""The router's /metrics takes its API key beyond loopback (services/router/server.py
``metrics_open``): the lab's Prometheus and the Kubernetes PodMonitor send it."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_labs_prometheus_sends_the_routers_api_key():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "router"]
    mounts = {c["target"]: c["source"] for c in compose["services"]["prometheus"]["configs"]}
    source = mounts[job["authorization"]["credentials_file"]]
    router_key = compose["services"]["router"]["environment"]["PDSERVE_ROUTER_API_KEY"]
    # the config holds the variable the router's key comes from (the router's adds an error
    # message for when it is unset)
    assert compose["configs"][source]["content"] == "${PDSERVE_API_KEY}"
    assert router_key.startswith("${PDSERVE_API_KEY:?")
    assert "metrics_open" not in str(compose["services"]["router"])  # not opened instead


def test_the_podmonitor_sends_the_routers_api_key():
    monitor = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "podmonitor.yaml").read_text())
    (endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "http"]
    assert endpoint["authorization"]["credentials"] == {"name": "pdserve-api-key", "key": "api-key"}
    router = yaml.safe_load_all((DEPLOY / "k8s" / "router.yaml").read_text())
    text = str(list(router))
    assert "pdserve-api-key" in text and "'key': 'api-key'" in text  # the Secret the router reads
