"""Hosts on one machine: one network namespace per host, each with its own address on a
bridge (veth pairs), so nothing can rely on 127.0.0.1 reaching another service."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _forward_rule(action: str, bridge: str) -> bool:
    """Adds (``-I``) or removes (``-D``) an iptables rule letting traffic between the lab's
    hosts through the bridge. A host running Docker sets the FORWARD policy to DROP, and with
    ``br_netfilter`` loaded (Docker loads it) bridged frames pass that chain: without the rule
    no host reaches another. No iptables, no filter: nothing to do. True when the rule is
    there after ``-I`` (or ``-C``)."""
    if shutil.which("iptables") is None:
        return False
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    res = subprocess.run(["iptables", "-w", action, *rule], capture_output=True, text=True)
    if action == "-I" and res.returncode != 0:
        raise RuntimeError(f"iptables {action} {' '.join(rule)}: {res.stderr.strip()}")
    return res.returncode == 0


def forwarding_rule_left(bridge: str) -> bool:
    """Whether the lab's FORWARD rule for ``bridge`` is still in iptables."""
    return _forward_rule("-C", bridge)


def can_create_namespaces() -> str | None:
    """None when namespaces work here, else the reason they don't."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"pdprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", name)
    return None


@dataclass
class Lab:
    """A bridge ``br`` with address ``<subnet>.1`` in the root namespace and one namespace per
    host at ``<subnet>.<n>``."""

    tag: str
    subnet: str = "10.231.0"
    hosts: dict[str, str] = field(default_factory=dict)  # host name -> address
    _ns: dict[str, str] = field(default_factory=dict)  # host name -> namespace name
    _forwarding: bool = False  # our iptables FORWARD rule is in place

    @property
    def bridge(self) -> str:
        return f"pdbr{self.tag}"[:15]

    def __post_init__(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._forwarding = _forward_rule("-I", self.bridge)

    def add_host(self, name: str) -> str:
        n = len(self.hosts) + 2
        ns = f"pd{self.tag}{name}"[:30]
        veth, peer = f"pv{self.tag}{n}"[:15], f"pp{self.tag}{n}"[:15]
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        addr = f"{self.subnet}.{n}"
        _ip("addr", "add", f"{addr}/24", "dev", peer, ns=ns)
        _ip("link", "set", peer, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        self.hosts[name] = addr
        self._ns[name] = ns
        return addr

    def prefix(self, name: str) -> list[str]:
        """Command prefix that runs a program on host ``name``."""
        return ["ip", "netns", "exec", self._ns[name]]

    def cut(self, name: str) -> None:
        """Takes host ``name`` off the network (its link goes down)."""
        n = list(self.hosts).index(name) + 2
        _ip("link", "set", f"pp{self.tag}{n}"[:15], "down", ns=self._ns[name])

    def destroy(self) -> None:
        for ns in self._ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        if self._forwarding:
            _forward_rule("-D", self.bridge)
            self._forwarding = False
        self._ns.clear()
        self.hosts.clear()
