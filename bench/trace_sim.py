"""Offline simulation of trace replay: the nodes' tier stack and eviction, in block counts.

Each simulated node is a real node (kvstore.node.store.NodeStore) over count-only tiers
(kvstore/node/tiers/count.py: no payload bytes, no LMDB writes), fed the operations a daemon
does for the connector's requests: EXISTS (no touch), GET of the hit prefix, PUT of the
request's new full blocks. So its placement, promotion, write-through, room-making and
eviction orders are the node's own, not a second model of them. tests/store/
test_sim_matches_node.py checks it against a node over the real tiers, request by request;
bench/trace.py runs the same requests on real daemons and compares. Keys are placed over
nodes by the client's rendezvous placement (kvstore.client.placement.rank_many, one copy).

Orphans: blocks stored somewhere in the cluster whose parent is stored nowhere (they can
never be part of a hit prefix again). Measured every ``sample_every`` requests. On more than
one node, every ``orphan_every`` requests each node in turn (in node-id order) runs the orphan
pass the daemons run (kvstore/member/orphans.py; bench/trace.py asks the daemons for it at the
same points): it evicts (kvstore/node/orphans.py ``drop``) its blocks whose parent is on
neither the parent's owner nor itself, with their chains below them on the node.

One file (a little over 350 lines): the trace, the keys, the node and the replay loop are what
bench/trace.py, bench/trace_bound.py, bench/vllm_replay.py and the tests import together.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.block import BlockHeader, make_header  # noqa: E402
from kvstore.client.placement import Node, rank_many  # noqa: E402
from kvstore.config import EvictionSection, load_store_config  # noqa: E402
from kvstore.keys import BlockKey, Namespace  # noqa: E402
from kvstore.node import orphans as node_orphans  # noqa: E402
from kvstore.node.store import NodeStore  # noqa: E402
from kvstore.node.tiers.build import build_count_tiers  # noqa: E402
from kvstore.node.tiers.order_marginal import START_SHARE  # noqa: E402
from kvstore.node.tiers.tasks import Finishing  # noqa: E402

BLOCK_TOKENS = 512  # the traces' block size
UPPER_TIERS = EvictionSection().upper_tiers  # the node's default
GET_BATCH = 256  # keys per GET of the replay (bench/trace.py): the node holds them until it ends
# gzip-compressed as published (JSON lines): 1 MiB in the repository instead of 4
TRACES = {"conversation": "conversation_trace.jsonl.gz", "synthetic": "synthetic_trace.jsonl.gz"}


@dataclass(frozen=True)
class Request:
    timestamp_ms: int
    input_tokens: int
    hash_ids: tuple[int, ...]  # full blocks only: a partial tail block gets no key


def load_trace(name: str, limit: int | None = None) -> list[Request]:
    path = Path(__file__).resolve().parent / "traces" / TRACES[name]
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            full = d["input_length"] // BLOCK_TOKENS
            out.append(Request(int(d["timestamp"]), int(d["input_length"]), tuple(d["hash_ids"][:full])))
            if limit is not None and len(out) >= limit:
                break
    return out


def trace_namespace() -> Namespace:
    """Keys of a trace: one "token" per 512-token block, its hash id, chained by
    kvstore.keys (``key_i = H(key_{i-1} || hash_id_i)``): two requests share key i exactly
    when they share hash ids 0..i, as the trace's hash ids share a token prefix."""
    return Namespace("mooncake-trace", "uint8", 1)


class ChainKeys:
    """Each request's block keys (raw bytes), memoized per hash-id prefix."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self._memo: dict[tuple[int, ...], bytes] = {}

    def keys(self, hash_ids: tuple[int, ...]) -> list[bytes]:
        out: list[bytes] = []
        parent = BlockKey(self.ns.id.raw)
        for i in range(len(hash_ids)):
            pre = hash_ids[: i + 1]
            k = self._memo.get(pre)
            if k is None:
                k = self.ns.next_key(parent, [hash_ids[i]]).raw
                self._memo[pre] = k
            out.append(k)
            parent = BlockKey(k)
        return out


SIM_BLOCK = 8192  # a simulated block's bytes, payload + header: one DRAM slab, one disk unit


class SimTier:
    """What the simulation and its tests read of one of the node's tiers: its keys and its
    eviction order (the tier's own)."""

    def __init__(self, tier) -> None:
        self.tier = tier

    @property
    def keys(self) -> set[bytes]:
        return set(self.tier.keys())

    @property
    def order(self):
        return self.tier._order  # the tier's EvictionOrder: its policy, probation, counters


class SimNode:
    """A node in block counts: a real :class:`~kvstore.node.store.NodeStore` over count-only
    tiers (kvstore/node/tiers/count.py: the node's own placement, promotion, write-through,
    room-making and eviction orders, no payload bytes): DRAM of ``dram_blocks`` and, unless
    ``disk_blocks`` is 0, a write-through disk of ``disk_blocks`` (None: ``unlimited``).
    Every block is :data:`SIM_BLOCK` bytes (a zero payload, one header length), so a tier of
    N blocks' bytes holds N blocks. The node runs on an event loop of its own, in a thread
    (callable from sync code and from inside another loop alike); :meth:`close` ends it."""

    def __init__(
        self,
        dram_blocks: int | None,
        disk_blocks: int | None,
        policy: str,
        probation: float,
        marginal_start: float = START_SHARE,
        upper_tiers: str = UPPER_TIERS,
        unlimited: int = 1 << 18,
    ):
        self._tmp = tempfile.TemporaryDirectory(prefix="tierkv-sim-")
        self.ns = trace_namespace()
        self._payload = bytes(SIM_BLOCK // 2)  # a length of the same width: the header's length
        self._payload = bytes(SIM_BLOCK - len(self._header(self.ns.id.raw, self.ns.id.raw).encode()))
        dram = unlimited if dram_blocks is None else dram_blocks
        disk = unlimited if disk_blocks is None else disk_blocks
        if dram < 2:
            raise ValueError(f"dram_blocks {dram_blocks}: a node's DRAM holds at least 2 blocks")
        cfg = load_store_config(
            None,
            {
                "node.index_memory": (dram + disk) * 2048 + (64 << 20),  # never the bound
                "dram.capacity": dram * SIM_BLOCK,
                "dram.slab_size": SIM_BLOCK,
                "disk.enabled": disk != 0,
                "disk.path": self._tmp.name,
                "disk.capacity": disk * SIM_BLOCK,
                "disk.sync": False,
                "eviction.policy": policy,
                "eviction.probation": probation,
                "eviction.marginal_start": marginal_start,
                "eviction.upper_tiers": upper_tiers,
            },
            env={},
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierkv-sim-node", daemon=True)
        self._thread.start()
        self.node: NodeStore = self._run(self._open(cfg))
        self.dram = SimTier(self.node.stack.dram)
        self.disk = SimTier(self.node.stack.disk) if self.node.stack.disk is not None else None
        self.parent: dict[bytes, bytes] = {}  # every key put here -> its parent (pruned by orphan_pass)
        self.hits = {"dram": 0, "disk": 0}
        self._bufs: list[bytearray] = []

    @staticmethod
    async def _open(cfg) -> NodeStore:
        finishing = Finishing()
        memory, disk = build_count_tiers(cfg, finishing)
        return NodeStore(cfg, memory, disk, finishing)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _header(self, key: bytes, parent: bytes) -> BlockHeader:
        return make_header(
            key=BlockKey(key), parent=BlockKey(parent), namespace=self.ns.id, tokens=[0],
            dtype="uint8", shape=[len(self._payload)], payload=self._payload, created=0.0,
        )  # fmt: skip

    def close(self) -> None:
        self._run(self.node.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._tmp.cleanup()

    def has(self, key: bytes) -> bool:
        return self.node.state.where(key) is not None

    def get(self, keys: list[bytes]) -> None:
        """One GET of ``keys`` (in chain order), the node's read (kvstore/node/reads.py);
        ``hits`` counts the keys found, by the tier they were in."""
        where = self.node.state.where
        for k in keys:
            t = where(k)
            if t is not None:
                self.hits["disk" if t is self.node.stack.disk else "dram"] += 1
        while len(self._bufs) < len(keys):
            self._bufs.append(bytearray(len(self._payload)))
        self._run(self.node.reader.read([BlockKey(k) for k in keys], self._bufs[: len(keys)]))

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        """One PUT of (key, parent) blocks, the node's write (kvstore/node/writes.py)."""
        blocks = []
        for key, parent in items:
            self.parent[key] = parent
            h = self._header(key, parent)
            if len(self._payload) + len(h.encode()) != SIM_BLOCK:  # a tier of N blocks' bytes: N blocks
                raise ValueError(f"simulated block {key.hex()}: header of another length")
            blocks.append((h, self._payload))
        self._run(self.node.writer.put(blocks))

    def drop(self, keys: list[bytes]) -> None:
        """Evict ``keys`` as the orphan pass does (kvstore/node/orphans.py ``drop``)."""
        self._run(node_orphans.drop(self.node, keys))

    def stored(self) -> set[bytes]:
        return self.dram.keys | (self.disk.keys if self.disk is not None else set())


@dataclass
class Replay:
    input_tokens: int = 0
    hit_tokens: int = 0
    hits: dict = field(default_factory=lambda: {"dram": 0, "disk": 0})
    orphan_samples: list = field(default_factory=list)
    orphans_evicted: int = 0  # by the orphan passes

    @property
    def hit_token_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def orphan_ratio(self) -> float:
        return sum(self.orphan_samples) / len(self.orphan_samples) if self.orphan_samples else 0.0


def orphan_pass(sims: dict[str, SimNode], owner: dict[bytes, str], node: str, root: bytes) -> int:
    """The orphan pass of ``node`` (see the module docstring); the blocks it evicted."""
    s = sims[node]
    s.parent = {k: p for k, p in s.parent.items() if s.has(k)}
    lost = [
        k
        for k, p in s.parent.items()
        if p != root and s.has(k) and not s.has(p) and not sims[owner[p]].has(p)
    ]
    if not lost:
        return 0
    kids: dict[bytes, list[bytes]] = {}
    for k, p in s.parent.items():
        if s.has(k):
            kids.setdefault(p, []).append(k)
    doomed, todo = dict.fromkeys(lost), list(lost)  # a dict: evicted in one order every run
    while todo:
        for c in kids.get(todo.pop(), ()):
            if c not in doomed:
                doomed[c] = None
                todo.append(c)
    s.drop(list(doomed))
    return len(doomed)


def node_ids(n: int, placement: int = 0) -> list[str]:
    """The addresses of ``n`` simulated nodes. Rendezvous placement hashes each key with each
    node's address, so which keys share a node -- and so how evenly a window of writes loads
    the nodes -- depends on the addresses: ``placement`` p names another set of addresses
    (ports ``20000 + p * n`` on), one more draw of the same cluster (bench/trace.py averages
    three-node cells over several)."""
    return [f"127.0.0.1:{20000 + placement * n + i}" for i in range(n)]


def simulate(
    requests: list[Request],
    nodes: int,
    capacity: int | None,
    tiers: str,
    policy: str,
    probation: float = 0.1,
    ids: list[str] | None = None,
    sample_every: int = 200,
    orphan_every: int = 0,
    marginal_start: float = START_SHARE,
    upper_tiers: str = UPPER_TIERS,
) -> Replay:
    """Replay ``requests`` over ``nodes`` simulated nodes holding ``capacity`` blocks in all
    (None: unlimited). ``tiers``: "dram" (DRAM only) or "dram+disk" (DRAM holds a quarter
    of ``capacity``, disk all of it, write-through). Orphans are counted against capacity.
    ``orphan_every``: requests between two orphan passes on more than one node (0: none; an
    unlimited cluster evicts nothing, so its passes would find nothing and are skipped).
    ``probation``, ``marginal_start``, ``upper_tiers``: as ``[eviction]``'s (the node's
    defaults)."""
    ids = ids or node_ids(nodes)
    per = None if capacity is None else capacity // nodes
    dram = per if tiers == "dram" else (None if per is None else max(per // 4, 1))
    disk = 0 if tiers == "dram" else per
    unlimited = len({r.hash_ids[: i + 1] for r in requests for i in range(len(r.hash_ids))}) + 2
    sims = {i: SimNode(dram, disk, policy, probation, marginal_start, upper_tiers, unlimited) for i in ids}
    try:
        return _replay(requests, sims, nodes, capacity, ids, sample_every, orphan_every)
    finally:
        for s in sims.values():
            s.close()


def _replay(
    requests: list[Request],
    sims: dict[str, SimNode],
    nodes: int,
    capacity: int | None,
    ids: list[str],
    sample_every: int,
    orphan_every: int,
) -> Replay:
    view = [Node(i) for i in ids]
    chain = ChainKeys(trace_namespace())
    root = chain.ns.id.raw
    owner: dict[bytes, str] = {}
    out = Replay()
    for n, req in enumerate(requests):
        keys = chain.keys(req.hash_ids)
        new = [k for k in keys if k not in owner]
        if new:
            for k, order in zip(new, rank_many(new, view, 1)):
                owner[k] = order[0]
        out.input_tokens += req.input_tokens
        hit = 0
        for k in keys:  # EXISTS: the leading run of present keys is the hit prefix
            if not sims[owner[k]].has(k):
                break
            hit += 1
        for start in range(0, hit, GET_BATCH):  # the replay's GETs, one per owner
            gets: dict[str, list[bytes]] = {}
            for k in keys[start : min(hit, start + GET_BATCH)]:
                gets.setdefault(owner[k], []).append(k)
            for node, got in gets.items():
                sims[node].get(got)
        out.hit_tokens += hit * BLOCK_TOKENS
        parents = [root, *keys[:-1]]
        batches: dict[str, list[tuple[bytes, bytes]]] = {}
        for k, p in list(zip(keys, parents))[hit:]:  # the client's PUT: one batch per owner
            batches.setdefault(owner[k], []).append((k, p))
        for node, items in batches.items():
            sims[node].put(items)
        if orphan_every and nodes > 1 and capacity is not None and (n + 1) % orphan_every == 0:
            for i in ids:
                out.orphans_evicted += orphan_pass(sims, owner, i, root)
        if sample_every and (n + 1) % sample_every == 0 and capacity is not None:
            out.orphan_samples.append(orphan_blocks(sims, root) / capacity)
    for s in sims.values():
        for t in out.hits:
            out.hits[t] += s.hits[t]
    return out


def orphan_blocks(sims: dict[str, SimNode], root: bytes) -> int:
    """Blocks stored on some node whose parent is stored on none."""
    stored: set[bytes] = set()
    parents: dict[bytes, bytes] = {}
    for s in sims.values():
        stored |= s.stored()
        parents.update(s.parent)
    return sum(1 for k in stored if parents[k] != root and parents[k] not in stored)
