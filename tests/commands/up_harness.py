"""Starts `pdserve up` for a test: on free ports, its run dir under the test's tmp_path,
returning once its banner is out."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pdserve.procs import free_ports


def start_up(
    tmp_path: Path, *flags: str, timeout: float = 300, prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen, str, dict[str, int], Path]:
    """``pdserve up FLAGS`` plus ports and run dir: (process, banner, ports, run dir)."""
    proc, ports, run_dir = launch_up(tmp_path, *flags, prefix=prefix)
    return proc, read_banner(proc, timeout), ports, run_dir


def quiet_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, below the kernel's ephemeral range. Outgoing connections
    take their ports from that range, and so does :func:`free_ports`: up binds its ports
    seconds to a minute after they are picked (the router after the workers are ready), and on
    a busy machine another test's connection took one meanwhile (meta's, CI, 'address already
    in use')."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    out: list[int] = []
    for port in random.sample(range(20000, min(low, 32768)), 400):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    return free_ports(n)


def quiet_pair(avoid: Iterable[int] = ()) -> int:
    """A port ``p`` below the kernel's ephemeral range with ``p`` and ``p + 1`` free now and
    neither in ``avoid`` (two HA masters, an etcd's client and peer ports)."""
    import socket

    avoid = set(avoid)
    while True:
        (port,) = quiet_ports(1)
        if {port, port + 1} & avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def launch_up(
    tmp_path: Path, *flags: str, prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen, dict[str, int], Path]:
    """``pdserve up FLAGS`` plus ports and run dir, started (its banner not read yet: see
    :func:`read_banner`), run by ``prefix`` (a command that runs its arguments, e.g.
    :func:`searchable`'s): (process, ports, run dir)."""
    meta, meta_http, master, router, http = quiet_ports(5)
    run_dir = tmp_path / "run"
    cmd = [
        *prefix, sys.executable, "-m", "pdserve.commands.cli", "up", *flags,
        "--meta-port", str(meta), "--meta-http-port", str(meta_http), "--master-port",
        str(master), "--router-port", str(router), "--http-port", str(http),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, {"meta": meta, "master": master, "http": http}, run_dir


def read_banner(
    proc: subprocess.Popen, timeout: float = 300, failed: Callable[[], str] | None = None
) -> str:
    """The banner of a :func:`launch_up` process, once it is out (AssertionError with its
    stderr when it exits or the time runs out, or with what ``failed`` says when it says
    something: a process up waits for that died; checked between the lines up prints)."""
    banner = ""
    deadline = time.monotonic() + timeout
    while "Ctrl-C stops everything" not in banner:
        why = failed() if failed is not None else ""
        if why or time.monotonic() > deadline or proc.poll() is not None:
            stop_up(proc)
            raise AssertionError(f"pdserve up did not come up: {why}\n{proc.stderr.read()[-4000:]}")
        banner += proc.stdout.readline()
    return banner


def stop_up(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C for a :func:`launch_up` process (it then stops what it started, even while still
    starting); killed when it does not exit within ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def shm_mapped(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files ``pids`` map (vLLM's queues, storage segments): those a clean stop
    must leave none of. Other tests may create their own files meanwhile, so checks name
    these rather than compare listings of the folder."""
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1].removesuffix(" (deleted)")
                if path.startswith("/dev/shm/"):
                    out.add(path)
    return out


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"


def dashboard_series() -> set[str]:
    """Every pdserve_* and vllm:* series name the shipped Grafana dashboard queries."""
    names: set[str] = set()

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                expr = re.sub(r'"[^"]*"', '""', t["expr"])  # label values are not names
                expr = re.sub(r"\[[^\]]*\]", "", expr)  # nor ranges
                names.update(re.findall(r"\b(?:pdserve_|vllm:)[a-zA-Z0-9_:]+", expr))
            walk(p.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return names


def scrape_discovered(banner: str, run_dir: Path) -> tuple[list[dict], set[str]]:
    """The targets meta's Prometheus HTTP service discovery (the banner's URL) lists, and the
    names of the samples a scrape of every one of them holds."""
    url = re.search(r"(https?://[\d.:]+/prometheus/targets)", banner).group(1)
    ctx = ssl.create_default_context(cafile=str(run_dir / "certs" / "ca.crt"))
    groups = json.loads(urllib.request.urlopen(url, context=ctx, timeout=10).read())
    names = set()
    for group in groups:
        for target in group["targets"]:
            text = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
            names |= {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln[:1] != "#"}
    return groups, names - {""}


def complete(http: int, prompt: str, key: str) -> dict:
    """A 4-token greedy completion of ``prompt`` by the tiny model through up's router."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}/v1/completions", data=body.encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def services_of(run_dir: Path) -> dict[str, dict]:
    """up's ``services.json`` in ``run_dir``: each service's record by its name."""
    data = json.loads((run_dir / "services.json").read_text())
    return {r["name"]: r for r in data["services"]}


def zombie(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def pids_with(*words: str) -> list[int]:
    """Live processes whose command line holds every one of ``words``."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if all(w in cmd for w in words) and not zombie(int(d.name)):
            out.append(int(d.name))
    return out
