"""The orphan pass (kvstore/client/orphans.py): a block whose parent another node evicted is
evicted by its own node's next pass, with its chain below it; a block whose parent is stored
stays. Two daemons in a static cluster (``cluster.peers``), one copy of each block."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from cluster.cluster_etcd import free_port
from storeutil import make_blocks

from kvstore.client.node import ClientConfig, NodeClient
from kvstore.client.placement import Node, rank
from kvstore.keys import Namespace

NS = Namespace("orphan-test", "uint8", 4)
CFG = ClientConfig(namespaces=(NS,), op_timeout_s=5.0, connect_timeout_s=1.0)
PAYLOAD = 4096


def _post(admin: str, path: str) -> dict:
    req = urllib.request.Request(admin + path, data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _metrics(admin: str) -> str:
    with urllib.request.urlopen(admin + "/metrics", timeout=30) as r:
        return r.read().decode()


async def _held(addr: str, keys) -> list[bool]:
    n = NodeClient(addr, CFG)
    try:
        return [t is not None for t in await n.exists(keys, 5.0)]
    finally:
        await n.close()


async def _put(addr: str, blocks) -> None:
    n = NodeClient(addr, CFG)
    try:
        res = await n.put(blocks, 10.0)
        assert [r.status.ok for r in res] == [True] * len(blocks), [r.status.name for r in res]
    finally:
        await n.close()


async def test_cluster_orphans_a_child_whose_parent_another_node_evicted_goes_at_the_next_pass(
    start_daemon, tmp_path
):
    ports = [free_port() for _ in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    member = {"cluster": {"peers": addrs}, "repair": {"enabled": False}, "orphans": {"interval_s": 3600.0}}
    # node A holds 16 blocks: fillers written to it evict the chain's blocks there
    a = start_daemon(
        use_disk=False, workdir=tmp_path / "a", server={"data_port": ports[0]},
        dram={"capacity": 16 * PAYLOAD, "slab_size": PAYLOAD}, **member,
    )  # fmt: skip
    b = start_daemon(
        use_disk=False, workdir=tmp_path / "b", server={"data_port": ports[1]},
        dram={"capacity": 256 * PAYLOAD, "slab_size": PAYLOAD}, **member,
    )  # fmt: skip
    chain = make_blocks(24, PAYLOAD, seed=3, ns=NS)
    view = [Node(x) for x in addrs]
    owner = [rank(h.key.raw, view, 1)[0].id for h, _ in chain]
    on_a = [i for i, o in enumerate(owner) if o == a.addr]
    on_b = [i for i, o in enumerate(owner) if o == b.addr]
    assert on_a and on_b and min(on_a) < max(on_b), owner  # some B block lies below an A block
    await _put(a.addr, [chain[i] for i in on_a])
    await _put(b.addr, [chain[i] for i in on_b])
    keys = [h.key for h, _ in chain]

    # a pass while every parent is stored drops nothing
    assert _post(b.admin, "/v1/orphans/pass")["orphans_found"] == 0
    assert await _held(b.addr, [keys[i] for i in on_b]) == [True] * len(on_b)

    fillers = make_blocks(64, PAYLOAD, seed=4, ns=NS)
    for i in range(0, len(fillers), 8):  # A evicts the chain's blocks
        await _put(a.addr, fillers[i : i + 8])
    assert await _held(a.addr, [keys[i] for i in on_a]) == [False] * len(on_a)
    # B's blocks below the first A block have lost a parent (or an ancestor on B): orphans;
    # B's leading run (the chain's first blocks, all on B) is intact and stays
    first_a = min(on_a)
    kept = [i for i in on_b if i < first_a]
    lost = [i for i in on_b if i > first_a]
    assert lost
    got = _post(b.admin, "/v1/orphans/pass")
    assert got["orphans_found"] == len(lost) and got["orphans_dropped"] == len(lost), got
    assert await _held(b.addr, [keys[i] for i in kept]) == [True] * len(kept)
    assert await _held(b.addr, [keys[i] for i in lost]) == [False] * len(lost)

    # orphaned bytes per tier and namespace, and evictions by reason, on /metrics
    text = _metrics(b.admin)
    nbytes = float(len(lost) * PAYLOAD)
    for name in ("tierkv_orphans_found_bytes_total", "tierkv_orphans_last_pass_bytes"):
        line = f'{name}{{namespace="{NS.id.hex}",tier="dram"}} {nbytes}'
        assert line in text, [x for x in text.splitlines() if "orphans_" in x]
    assert f'tierkv_tier_evictions_by_reason_total{{reason="orphan",tier="dram"}} {float(len(lost))}' in text
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--node", b.admin, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    orph = json.loads(r.stdout)["nodes"][0]["orphans"]
    assert orph["passes"] == 2 and orph["orphans_dropped"] == len(lost), orph
    assert orph["bytes"] == {"dram": {NS.id.hex: len(lost) * PAYLOAD}}, orph

    # the chain written again is stored again (an orphan's eviction leaves no tombstone)
    await _put(a.addr, [chain[i] for i in on_a])
    await _put(b.addr, [chain[i] for i in lost])
    assert await _held(b.addr, [keys[i] for i in on_b]) == [True] * len(on_b)


async def test_cluster_orphans_a_parent_whose_owner_does_not_answer_counts_as_present(start_daemon, tmp_path):
    port, dead = free_port(), free_port()
    addrs = [f"127.0.0.1:{port}", f"127.0.0.1:{dead}"]  # the second member never comes up
    d = start_daemon(
        use_disk=False, server={"data_port": port}, dram={"capacity": 256 * PAYLOAD, "slab_size": PAYLOAD},
        cluster={"peers": addrs}, repair={"enabled": False}, orphans={"interval_s": 3600.0, "deadline_s": 1.0},
    )  # fmt: skip
    chain = make_blocks(24, PAYLOAD, seed=5, ns=NS)
    view = [Node(x) for x in addrs]
    on_dead = {i for i, (h, _) in enumerate(chain) if rank(h.key.raw, view, 1)[0].id != d.addr}
    assert on_dead and len(on_dead) < len(chain)
    mine = [c for i, c in enumerate(chain) if i not in on_dead]
    await _put(d.addr, mine)  # the dead node's blocks were never written: their children's parents
    got = _post(d.admin, "/v1/orphans/pass")
    assert got["orphans_found"] == 0 and got["owners_unreachable"] >= 1, got
    assert await _held(d.addr, [h.key for h, _ in mine]) == [True] * len(mine)
