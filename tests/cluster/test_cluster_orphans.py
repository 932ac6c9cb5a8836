"""The orphan pass (kvstore/member/orphans.py): a block whose parent another node evicted is
evicted by its own node's next pass, with its chain below it; a block whose parent is stored
stays. Two daemons in a static cluster (``cluster.peers``), one copy of each block."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from cluster.cluster_etcd import free_port
from cluster.static_cluster import held, put_to
from polling import until_async
from storeutil import make_blocks

from kvstore.client.config import ClientConfig
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


def _counter(admin: str, name: str) -> float:
    """``tierkv_orphans_<name>_total`` on ``admin``'s /metrics (AssertionError when absent)."""
    line = f"tierkv_orphans_{name}_total "
    got = [float(x[len(line) :]) for x in _metrics(admin).splitlines() if x.startswith(line)]
    assert len(got) == 1, (name, got)
    return got[0]


async def _held(addr: str, keys) -> list[bool]:
    return await held(addr, keys, CFG)


async def _put(addr: str, blocks) -> None:
    await put_to(addr, blocks, CFG)


async def test_cluster_orphans_a_child_whose_parent_another_node_evicted_goes_at_the_next_pass(
    start_daemon, tmp_path
):
    chain = make_blocks(24, PAYLOAD, seed=3, ns=NS)
    # Ownership follows the addresses, and the ports are drawn at run time: draw until A's share
    # fits A's 16 blocks in one PUT (a PUT's own blocks never evict each other) and some B
    # block lies below an A block, so the test does not depend on which ports were free.
    for _ in range(200):
        ports = [free_port() for _ in range(2)]
        addrs = [f"127.0.0.1:{p}" for p in ports]
        view = [Node(x) for x in addrs]
        owner = [rank(h.key.raw, view, 1)[0].id for h, _ in chain]
        on_a = [i for i, o in enumerate(owner) if o == addrs[0]]
        on_b = [i for i, o in enumerate(owner) if o == addrs[1]]
        if 0 < len(on_a) <= 12 and on_b and min(on_a) < max(on_b):
            break
    assert 0 < len(on_a) <= 12 and on_b and min(on_a) < max(on_b), owner
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
    assert (a.addr, b.addr) == tuple(addrs)
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


def _three_members(start_daemon, tmp_path, orphans: dict, settle_s: float = 2.0):
    ports = [free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    repair = {"enabled": False, "replicas": 1, "settle_s": settle_s}  # the pass reuses settle_s
    member = {"cluster": {"peers": addrs}, "repair": repair, "orphans": orphans}
    ds = [
        start_daemon(
            use_disk=False,
            workdir=tmp_path / f"n{i}",
            server={"data_port": p},
            dram={"capacity": 256 * PAYLOAD, "slab_size": PAYLOAD},
            **member,
        )  # fmt: skip
        for i, p in enumerate(ports)
    ]
    return ds, [Node(x) for x in addrs]


def _parent_on_lookahead_node(view, chain):
    """Index ``i`` of a block whose parent (block ``i - 1``) has its owner, its lookahead node
    (rank 2: where a write goes while the owner is down) and the child's owner all distinct."""
    for i in range(1, len(chain)):
        p_order = [n.id for n in rank(chain[i - 1][0].key.raw, view, 1)]
        c_owner = rank(chain[i][0].key.raw, view, 1)[0].id
        if c_owner not in p_order[:2]:
            return i, p_order[1], c_owner
    raise AssertionError("no such block in the chain")


async def test_cluster_orphans_a_parent_on_its_lookahead_node_keeps_its_child(start_daemon, tmp_path):
    # one copy: the parent's owner was down when it was written, so it sits on the next-ranked
    # node, where a client's lookup (lookahead 1) still finds it
    ds, view = _three_members(start_daemon, tmp_path, {"interval_s": 3600.0})
    by_addr = {d.addr: d for d in ds}
    chain = make_blocks(24, PAYLOAD, seed=7, ns=NS)
    i, p_node, c_node = _parent_on_lookahead_node(view, chain)
    for j in range(i - 1):  # the ancestors on their owners
        await _put(rank(chain[j][0].key.raw, view, 1)[0].id, [chain[j]])
    await _put(p_node, [chain[i - 1]])
    await _put(c_node, [chain[i]])
    got = _post(by_addr[c_node].admin, "/v1/orphans/pass")
    assert got["blocks_checked"] >= 1 and got["orphans_found"] == 0, got
    assert await _held(c_node, [chain[i][0].key]) == [True]


async def test_cluster_orphans_no_periodic_pass_before_the_view_settled(start_daemon, tmp_path):
    # passes every 0.2 s, but the view (which changed at start) must stay unchanged an hour first
    ds, view = _three_members(start_daemon, tmp_path, {"interval_s": 0.2}, settle_s=3600.0)
    chain = make_blocks(8, PAYLOAD, seed=8, ns=NS)
    owner = [rank(h.key.raw, view, 1)[0].id for h, _ in chain]
    orphan = next(j for j in range(1, len(chain)) if owner[j] != owner[j - 1])
    await _put(owner[orphan], [chain[orphan]])  # its parent was never written: an orphan
    d = next(d for d in ds if d.addr == owner[orphan])
    await until_async(
        lambda: _counter(d.admin, "passes_skipped_settling"),
        60.0,
        "three passes skipped",
        ok=lambda n: n >= 3,
    )
    assert _counter(d.admin, "passes") == 0
    assert await _held(d.addr, [chain[orphan][0].key]) == [True]
    # asked, it runs now (the admin route is the operator's call) and drops the orphan
    assert _post(d.admin, "/v1/orphans/pass")["orphans_dropped"] == 1
