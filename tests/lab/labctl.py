"""The running compose lab, seen from the host: its containers (docker CLI), the router's
public gRPC API (the API key, no client certificate), a worker's /metrics (read inside its
container, where port 9100 is not published) and the links' shaping (deploy/lab/shape.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "deploy" / "lab" / "lab.sh"
SHAPE = ROOT / "deploy" / "lab" / "shape.sh"
ENV_FILE = ROOT / "build" / "lab" / "lab.env"
PROJECT = "pdserve-lab"
DOCKER = "/usr/bin/docker"
ROUTER = "127.0.0.1:50060"
#: nginx in front of the router (the compose service `gateway`): HTTPS and gRPC over TLS.
GATEWAY = "127.0.0.1:8443"
ROUTER_HTTP = "http://127.0.0.1:8000"


def docker(*args: str, check: bool = True) -> str:
    res = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout.strip()


def lab(*args: str) -> subprocess.CompletedProcess:
    """deploy/lab/lab.sh ARGS (up, down, compose ...), output captured."""
    return subprocess.run(["bash", str(LAB), *args], capture_output=True, text=True, timeout=1200)


def shape(*args: str) -> subprocess.CompletedProcess:
    """deploy/lab/shape.sh ARGS, output captured."""
    return subprocess.run(["bash", str(SHAPE), *args], capture_output=True, text=True, timeout=60)


def api_key() -> str:
    if os.environ.get("PDSERVE_API_KEY"):
        return os.environ["PDSERVE_API_KEY"]
    match = re.search(r"^PDSERVE_API_KEY=(\S+)$", ENV_FILE.read_text(), re.M)
    assert match, f"no key in {ENV_FILE}"
    return match.group(1)


def gateway_key(team: str) -> str:
    """The gateway key of ``team`` (team-a, team-b): the compose file's gateway-keys map."""
    return f"{api_key()}-gw-{team}"


def lab_ca() -> bytes:
    """The lab's CA certificate (the certs volume, read inside the gateway's container)."""
    return docker("exec", container("gateway"), "cat", "/etc/pdserve/certs/ca.crt").encode() + b"\n"


def project_objects() -> dict[str, list[str]]:
    """The project's containers (any state), volumes and networks, by compose's label."""
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        kind: docker(*cmd, "--filter", label, "-q").split()
        for kind, cmd in (
            ("containers", ("ps", "-a")),
            ("volumes", ("volume", "ls")),
            ("networks", ("network", "ls")),
        )
    }


def container(service: str) -> str:
    """The id of ``service``'s container (running or not)."""
    ids = docker(
        "ps", "-a", "-q",
        "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--filter", f"label=com.docker.compose.service={service}",
    ).split()  # fmt: skip
    assert len(ids) == 1, f"{service}: containers {ids}"
    return ids[0]


def health(service: str) -> str:
    state = json.loads(docker("inspect", "-f", "{{json .State}}", container(service)))
    return state.get("Health", {}).get("Status", state["Status"])


def wait_healthy(service: str, timeout: float = 600.0) -> float:
    """Seconds until ``service``'s healthcheck passes (polls docker inspect)."""
    start = time.monotonic()
    while (status := health(service)) != "healthy":
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{service} not healthy after {timeout:.0f} s: {status}")
        time.sleep(0.5)
    return time.monotonic() - start


def wait_until(condition, timeout: float) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (polled twice a second)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.5)
    return True


def leads(master: str) -> bool:
    """Whether KV store master ``master`` leads (its health without --standby-ok passes)."""
    res = subprocess.run(
        [DOCKER, "exec", container(master), "pdserve", "health", f"{master}:50051"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return res.returncode == 0


def metric(service: str, name: str, labels: str = "") -> float:
    """Sum of ``name`` samples (whose labels contain ``labels``) on ``service``'s /metrics."""
    text = docker(
        "exec", container(service), "curl", "-sf",
        "-H", f"Authorization: Bearer {api_key()}", f"http://{service}:9100/metrics",
    )  # fmt: skip
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Answer:
    tokens: list[int]
    cached: int
    ttft_s: float
    logprobs: list[float]


class Router:
    """The router's public gRPC API with the lab's API key; or, given ``ca``, the same API
    through the gateway (TLS to nginx) with ``key``, a team's gateway key."""

    def __init__(self, key: str | None = None, ca: bytes | None = None) -> None:
        if ca is None:
            self.channel = grpc.insecure_channel(ROUTER)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self.channel = grpc.secure_channel(GATEWAY, creds)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.meta = (("authorization", f"Bearer {key or api_key()}"),)

    def generate(
        self, prompt: list[int], n: int, timeout: float = 120.0, logprobs: int | None = None
    ) -> Answer:
        """Greedy ``n`` tokens of ``prompt`` (token ids), with the time to the first token
        (and each token's logprob when ``logprobs`` is given)."""
        sampling = common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        if logprobs is not None:
            sampling.logprobs = logprobs
        req = router_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
        start = time.monotonic()
        tokens: list[int] = []
        lps: list[float] = []
        cached, ttft = 0, 0.0
        for msg in self.stub.GenerateStream(
            req, timeout=timeout, metadata=self.meta, wait_for_ready=True
        ):
            if msg.token_ids and not tokens:
                ttft = time.monotonic() - start
            tokens.extend(msg.token_ids)
            lps.extend(msg.logprobs.token_logprobs)
            cached = max(cached, msg.cached_tokens)
        return Answer(tokens, cached, ttft, lps)

    def close(self) -> None:
        self.channel.close()
