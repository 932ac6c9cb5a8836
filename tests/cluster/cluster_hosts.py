"""A cluster of real daemons on separate (namespaced) hosts, for the fault scenarios.

Each daemon runs inside its host's namespace, bound to that host's address, with a token
file (a daemon without auth binds loopback only, so auth is what lets it listen on the
bridge). Clients in the test process reach the hosts over the bridge.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster.cluster_etcd import Etcd, etcd_missing
from cluster.cluster_netns import Host, Net
from daemonutil import REPO, Daemon, _toml, wait_serving

from kvstore.client.config import ClientConfig
from kvstore.keys import Namespace

TOKEN, TENANT = "tok-cluster-test-0001", "acme"
OPERATOR_TOKEN = "tok-cluster-operator-0001"  # the nodes' repair reaches its peers with it
NS = Namespace("cluster-test", "uint8", 4)
TENANT_NS = NS.with_tenant(TENANT)  # the node salts keys with the token's tenant


class NsDaemon(Daemon):
    def __init__(self, host: Host, *args) -> None:
        super().__init__(*args)
        self.host = host

    @property
    def addr(self) -> str:
        return f"{self.host.ip}:{self.ports['data_port']}"


class Cluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.net = Net()
        self.daemons: list[NsDaemon] = []
        self.etcd: Etcd | None = None
        self.token_file = workdir / "tokens"
        self.token_file.write_text(f"{TOKEN} {TENANT}\n{OPERATOR_TOKEN} *\n")

    def client_cfg(self, **kw) -> ClientConfig:
        base = dict(token=TOKEN, tenant=TENANT, namespaces=(NS,), connect_timeout_s=0.5, probe_interval_s=0.1)
        base.update(kw)
        return ClientConfig(**base)

    def start_etcd(self) -> Etcd:
        """etcd on the bridge address (reachable from every host and from the test); skips the
        test with the one etcd reason when it is not installed."""
        if etcd_missing():
            pytest.skip(etcd_missing())
        d = self.workdir / "etcd"
        d.mkdir(exist_ok=True)
        self.etcd = Etcd(d, self.net.gateway)
        self.etcd.start()
        return self.etcd

    def start_node(self, join: str = "", zone: str = "", lease_ttl_s: int = 2) -> NsDaemon:
        host = self.net.add_host()
        wd = self.workdir / host.ns
        wd.mkdir()
        cfg = {
            "node": {"name": host.ns, "zone": zone},
            "dram": {"capacity": "64MiB", "slab_size": "1MiB"},
            "disk": {"enabled": False},
            "server": {"host": host.ip, "port_file": str(wd / "ports.json")},
            "auth": {"token_file": str(self.token_file)},
            "cluster": {"join": join, "lease_ttl_s": lease_ttl_s},
        }
        text = "".join(
            f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in vals.items()) for s, vals in cfg.items()
        )
        (wd / "node.toml").write_text(text)
        log = wd / "daemon.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                host.cmd(sys.executable, "-m", "kvstore.cli", "serve", "--config", str(wd / "node.toml")),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        d = NsDaemon(host, proc, wait_serving(proc, wd / "ports.json", log), wd, log)
        self.daemons.append(d)
        return d

    def teardown(self) -> None:
        for d in self.daemons:
            d.stop(10)
        if self.etcd is not None:
            self.etcd.stop()
        self.net.teardown()
