"""The compose lab's gateway (nginx, docs/gateway.md) checked without Docker: its command
fills every placeholder of deploy/nginx/pdserve.conf from its environment, the result passes
`nginx -t` with the lab's certificates and key map, the router trusts the header from the
gateway's fixed address only, and the tenants nginx names are the router's."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
TEMPLATE = ROOT / "deploy" / "nginx" / "pdserve.conf"
KEY = "k" * 32


def _gateway() -> dict:
    return COMPOSE["services"]["gateway"]


def _config(name: str) -> str:
    return COMPOSE["configs"][name]["content"].replace("${PDSERVE_API_KEY}", KEY)


def _envsubst_names() -> set[str]:
    script = _gateway()["command"][-1]
    (listed,) = re.findall(r"envsubst '([^']*)'", script)
    return {n.removeprefix("$$") for n in listed.split()}


def test_the_command_fills_every_placeholder_from_the_environment():
    placeholders = set(re.findall(r"\$\{(\w+)\}", TEMPLATE.read_text()))
    env = _gateway()["environment"]
    assert _envsubst_names() == placeholders == set(env), (placeholders, set(env))
    assert "./nginx/pdserve.conf:/etc/nginx/pdserve.conf.template:ro" in _gateway()["volumes"]


def test_the_router_trusts_the_gateway_by_its_fixed_address_only():
    router = shlex.split(COMPOSE["services"]["router"]["command"])
    peers = router[router.index("--gateway-peers") + 1]
    address = _gateway()["networks"]["default"]["ipv4_address"]
    assert peers == address  # one address, not the lab's subnet (a worker may not name tenants)
    (subnet,) = COMPOSE["networks"]["default"]["ipam"]["config"]
    import ipaddress

    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet["subnet"])
    # nginx's tenants are the router's
    named = set(re.findall(r'" (\S+);', _config("gateway-keys")))
    tenants = {line.split()[0] for line in _config("tenants").splitlines() if line.strip()}
    assert named and named <= tenants, (named, tenants)
    # a gateway key is no key the router takes itself
    gw_keys = set(re.findall(r'"Bearer (\S+)"', _config("gateway-keys")))
    router_keys = {line.split()[1] for line in _config("tenants").splitlines() if line.strip()}
    assert not gw_keys & router_keys


@pytest.mark.slow  # runs nginx -t (a process)
def test_the_rendered_config_passes_nginx_t(tmp_path: Path):
    from nginx_harness import nginx_binary, render

    from pdserve.commands import certs

    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed (scripts/setup.sh installs it)")
    argv = shlex.split(COMPOSE["services"]["certs"]["command"])
    names = [a for a in argv if ":" in a and not a.startswith("-")]
    assert "gateway:nginx" in names
    certs.make(tmp_path, ["gateway:nginx"])
    keys = tmp_path / "gateway-keys"
    keys.write_text(_config("gateway-keys"))
    env = dict(_gateway()["environment"])
    local = {"/etc/pdserve/certs/": f"{tmp_path}/", "/etc/nginx/pdserve-gateway-keys": str(keys)}
    for name, value in env.items():
        for container, here in local.items():
            value = value.replace(container, here)
        env[name] = value
    env["NGINX_RUN"] = str(tmp_path / "run")
    # the compose names resolve only inside the lab's network
    env["ROUTER_HTTP"], env["ROUTER_GRPC"] = "127.0.0.1:8000", "127.0.0.1:50060"
    (tmp_path / "run").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(TEMPLATE.read_text(), env))
    res = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
