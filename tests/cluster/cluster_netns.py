"""Separate hosts on one machine: a Linux bridge in the test's namespace with a private /24,
and one network namespace per host joined to it by a veth pair. Root only; everything made
here is removed by :meth:`Net.teardown` (deleting a namespace deletes its veth pair).

Faults act on the host-side end of a host's veth: ``partition`` takes the link down (packets
to and from the host vanish), ``slow`` adds a netem delay, ``heal`` undoes both.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def cannot_make_namespaces() -> str:
    """Why network namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs these as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 is not installed (Debian: iproute2; `make test` installs it when run as root)"
    probe = f"tkvprobe{secrets.token_hex(3)}"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return ""


@dataclass
class Host:
    ns: str
    ip: str
    veth: str  # the host-side end, on the bridge
    peer: str  # the end inside the namespace

    def cmd(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *args]


class Net:
    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"tkb{self.tag}"
        self.prefix = self._free_prefix()
        self.gateway = f"{self.prefix}.1"
        self.hosts: list[Host] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    @staticmethod
    def _free_prefix() -> str:
        used = sh("ip", "-4", "addr").stdout + sh("ip", "-4", "route").stdout
        rnd = random.Random()
        for _ in range(100):
            p = f"10.{rnd.randrange(200, 250)}.{rnd.randrange(0, 256)}"
            if f"{p}." not in used:
                return p
        raise RuntimeError("no free private /24 for the test bridge")

    def add_host(self) -> Host:
        i = len(self.hosts) + 1
        h = Host(f"tkv{self.tag}h{i}", f"{self.prefix}.{10 + i}", f"tkv{self.tag}v{i}", f"tkv{self.tag}p{i}")
        peer = h.peer
        sh("ip", "netns", "add", h.ns)
        self.hosts.append(h)
        sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", h.ns)
        sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", peer)
        sh("ip", "-n", h.ns, "link", "set", peer, "up")
        sh("ip", "-n", h.ns, "link", "set", "lo", "up")
        sh("ip", "link", "set", h.veth, "master", self.bridge)
        sh("ip", "link", "set", h.veth, "up")
        return h

    def partition(self, h: Host) -> None:
        sh("ip", "link", "set", h.veth, "down")

    def slow(self, h: Host, delay_ms: int) -> str:
        """Delay every packet towards ``h`` by ``delay_ms`` (netem). Where the kernel has no
        netem, shape both directions to a trickle with tbf instead (every packet then waits
        well over ``delay_ms``). Returns the qdisc used."""
        r = sh(
            "tc", "qdisc", "replace", "dev", h.veth, "root", "netem", "delay", f"{delay_ms}ms", check=False
        )
        if r.returncode == 0:
            return "netem"
        if "unknown" not in r.stderr.lower():
            raise RuntimeError(f"tc netem on {h.veth}: {r.stderr.strip()}")
        tbf = ("root", "tbf", "rate", "4kbit", "burst", "1600", "latency", "60s")
        sh("tc", "qdisc", "replace", "dev", h.veth, *tbf)
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev", h.peer, *tbf)
        return "tbf"

    def shape(self, h: Host, rate: str, burst: str) -> None:
        """A token bucket (tc tbf) on both directions of ``h``'s link: ``rate`` on average,
        ``burst`` bytes at full speed once the bucket refilled (what a congested or policed
        link does; a small probe fits in the burst)."""
        tbf = ("root", "tbf", "rate", rate, "burst", burst, "latency", "60s")
        sh("tc", "qdisc", "replace", "dev", h.veth, *tbf)
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev", h.peer, *tbf)

    def heal(self, h: Host) -> None:
        sh("tc", "qdisc", "del", "dev", h.veth, "root", check=False)
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", h.peer, "root", check=False)
        sh("ip", "link", "set", h.veth, "up")

    def teardown(self) -> None:
        for h in self.hosts:
            sh("ip", "netns", "del", h.ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
