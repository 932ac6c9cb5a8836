"""`kvstore … --cluster etcd://…`: the inspection CLI finds every node through etcd (nodes
register their admin address beside their data address when they `--join`)."""

from __future__ import annotations

import json
import subprocess
import sys

from cluster.cluster_etcd import until_view

from kvstore.client.etcd_membership import EtcdMembership


def _kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=60
    )


async def test_cli_discovers_nodes_through_etcd(etcd, start_daemon):
    url = etcd.url("cli")
    nodes = [start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 3}) for _ in range(2)]
    m = EtcdMembership(url)
    await m.start()
    await until_view(m, "both members", [d.addr for d in nodes])
    assert {x.admin for x in m.members} == {d.admin.removeprefix("http://") for d in nodes}
    await m.close()
    r = _kvstore("stats", "--cluster", url, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["nodes"]) == 2
    r = _kvstore("ls", "--cluster", etcd.url("nobody"))
    assert r.returncode == 2 and "no node of this cluster" in r.stderr
