"""`kvstore … --cluster etcd://…`: the inspection CLI finds every node through etcd (nodes
register their admin address beside their data address when they `--join`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

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
    end = time.monotonic() + 5
    while len(m.members) < 2:
        assert time.monotonic() < end, m.members
        await m.wait_changed(m.version, 0.2)
    assert {x.admin for x in m.members} == {d.admin.removeprefix("http://") for d in nodes}
    await m.close()
    r = _kvstore("stats", "--cluster", url, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["nodes"]) == 2
    r = _kvstore("ls", "--cluster", etcd.url("nobody"))
    assert r.returncode == 2 and "no node of this cluster" in r.stderr
