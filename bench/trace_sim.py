"""Offline simulation of trace replay: the nodes' tier stack and eviction, in block counts.

Each simulated node runs the real eviction orders (kvstore.node.tiers.order) over the same
operations a daemon does for the connector's requests: EXISTS (no touch), GET of the hit
prefix (a read touches, a DRAM hit the disk copy too, a GET's DRAM uses deepest first when
it ends; a disk hit moves into DRAM when that evicts only blocks disk also
holds and none the same GET read, and is touched there: the node's lease reads the DRAM
copy), PUT of the request's new full blocks (room made in DRAM by moving victims down to
disk, committed deepest first as kvstore.node.depth_order orders them, write-through to disk,
which evicts its own victims; a block DRAM has no room for goes to disk only). tests/store/
test_sim_matches_node.py checks a real node against it, request by request. Keys are placed
over nodes by
the client's rendezvous placement (kvstore.client.placement.rank_many, one copy). bench/trace.py
runs the same requests on real daemons and compares.

Orphans: blocks stored somewhere in the cluster whose parent is stored nowhere (they can
never be part of a hit prefix again). Measured every ``sample_every`` requests. On more than
one node, every ``orphan_every`` requests each node in turn (in node-id order) runs the orphan
pass the daemons run (kvstore/client/orphans.py; bench/trace.py asks the daemons for it at the
same points): it evicts its blocks whose parent is on neither the parent's owner nor itself,
with their chains below them on the node.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.client.placement import Node, rank_many  # noqa: E402
from kvstore.config import EvictionSection  # noqa: E402
from kvstore.keys import BlockKey, Namespace  # noqa: E402
from kvstore.node.depth_order import commit_order  # noqa: E402
from kvstore.node.tiers.order import make_order  # noqa: E402
from kvstore.node.tiers.order_marginal import START_SHARE  # noqa: E402

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


class SimTier:
    def __init__(
        self,
        name: str,
        capacity: int | None,
        policy: str,
        probation: float,
        top: bool = True,
        marginal_start: float = START_SHARE,
    ) -> None:
        self.name, self.capacity = name, capacity
        # as kvstore.node.tiers.build
        self.order = make_order(policy, probation, marks_orphans=top, marginal_start=marginal_start)
        self.keys: set[bytes] = set()
        self.reserved = 0  # slots taken by a PUT not committed yet

    def full(self) -> bool:
        return self.capacity is not None and len(self.keys) + self.reserved >= self.capacity

    def add(self, key: bytes, parent: bytes, demoted: bool = False) -> None:
        self.keys.add(key)
        self.order.add(key, parent, demoted)

    def remove(self, key: bytes) -> None:
        self.keys.discard(key)
        self.order.discard(key)


class SimNode:
    """A node: DRAM, and disk (write-through) when ``disk_blocks`` is not 0."""

    def __init__(
        self,
        dram_blocks: int | None,
        disk_blocks: int | None,
        policy: str,
        probation: float,
        marginal_start: float = START_SHARE,
        upper_tiers: str = UPPER_TIERS,
    ):
        # DRAM above the write-through disk runs the policy, or keeps recency under upper_tiers "recency"
        # (kvstore.node.tiers.build: EvictionSection.tier_policy)
        dram_policy = EvictionSection(policy=policy, upper_tiers=upper_tiers).tier_policy(disk_blocks != 0)  # type: ignore[arg-type]
        self.dram = SimTier("dram", dram_blocks, dram_policy, probation, marginal_start=marginal_start)
        self.disk = (
            SimTier("disk", disk_blocks, policy, probation, False, marginal_start)
            if disk_blocks != 0
            else None
        )
        self.parent: dict[bytes, bytes] = {}
        self.hits = {"dram": 0, "disk": 0}

    def has(self, key: bytes) -> bool:
        return key in self.dram.keys or (self.disk is not None and key in self.disk.keys)

    def get(self, keys: list[bytes]) -> None:
        """One GET of ``keys`` (in chain order) as the node's lease of them
        (kvstore/node/leasing.py): the keys read so far are held until it ends, so a promotion
        does not evict them from DRAM; a disk hit touches the disk's copy as it is read; the
        DRAM uses (a DRAM hit, a promoted block read from its new slot) are marked when the
        GET ends, deepest first, each on the disk's copy too (``_touch_dram``)."""
        held: set[bytes] = set()
        used: list[bytes] = []
        for key in keys:
            held.add(key)
            if key in self.dram.keys:
                used.append(key)
                self.hits["dram"] += 1
                continue
            if self.disk is None or key not in self.disk.keys:
                continue
            self.disk.order.touch(key)
            self.hits["disk"] += 1
            if self._room_without_io(held):
                # the node's lease of a promoted block reads it from its new DRAM slot, and that
                # read touches it (kvstore/node/leasing.py): it joins DRAM's main segment, not
                # probation. Without this touch the simulation drifted from the node from the
                # first promotion on (tests/store/test_sim_matches_node.py).
                self.dram.add(key, self.parent[key])
                used.append(key)
        for key in reversed(used):
            self._touch_dram(key)

    def _touch_dram(self, key: bytes) -> None:
        """A use of ``key`` in DRAM: touched there and in the disk's order (a no-op where the
        disk has no copy), as kvstore.node.tiers.stack.TierStack.touch does."""
        self.dram.order.touch(key)
        if self.disk is not None:
            self.disk.order.touch(key)

    def _room_without_io(self, held: set[bytes]) -> bool:
        disk = self.disk.keys  # type: ignore[union-attr]
        while self.dram.full():
            victim = next((k for k in self.dram.order.candidates() if k in disk and k not in held), None)
            if victim is None:
                return False
            self.dram.remove(victim)
        return True

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        """One PUT of (key, parent) blocks: each reserved in DRAM in turn (room made by moving
        victims down; where none can be made -- DRAM all reserved by this PUT -- a block goes
        to disk only, as the node's placement sends it), then committed deepest first
        (kvstore/node/depth_order.py: the last run of consecutive blocks first) and written
        through to disk in one batch in that order, as the node does."""
        new, in_dram = [], set()
        for key, parent in items:
            if self.has(key):  # EXISTS: the node touches it in its highest tier, as a read
                if key in self.dram.keys:
                    self._touch_dram(key)
                else:
                    self.disk.order.touch(key)  # type: ignore[union-attr]
                continue
            self.parent[key] = parent
            while self.dram.full():
                victim = next(self.dram.order.candidates(), None)
                if victim is None:
                    break
                self.dram.remove(victim)
                if self.disk is not None and victim not in self.disk.keys:
                    self._disk_put([(victim, self.parent[victim])], demoted=True)
                self._forget_if_gone(victim)
            if not self.dram.full():
                self.dram.reserved += 1
                in_dram.add(key)
            elif self.disk is None:
                continue  # NO_SPACE
            new.append((key, parent))
        self.dram.reserved = 0
        new = [new[i] for i in commit_order([k for k, _ in new], [p for _, p in new])]
        for key, parent in new:  # committed deepest first
            if key in in_dram:
                self.dram.add(key, parent)
        if self.disk is not None and new:
            self._disk_put(new)
            for key, _ in new:  # a disk-only block the disk had no room for is nowhere
                self._forget_if_gone(key)

    def _disk_put(self, items: list[tuple[bytes, bytes]], demoted: bool = False) -> None:
        """One disk put: victims planned from one pass over the order, each counted as gone
        for the rest of the pass (the tier's plan); ``demoted``: blocks DRAM evicts."""
        disk = self.disk
        assert disk is not None
        held = {k for k, _ in items}
        todo = [(k, p) for k, p in items if k not in disk.keys]
        room = None if disk.capacity is None else disk.capacity - len(disk.keys)
        evict: list[bytes] = []
        if room is not None and room < len(todo):
            it = disk.order.candidates(lambda k: k not in held)
            try:
                for k in it:
                    evict.append(k)
                    if room + len(evict) >= len(todo):
                        break
            finally:
                it.close()
            todo = todo[: room + len(evict)]
        for v in evict:
            disk.remove(v)
            self._forget_if_gone(v)
        for k, p in todo:
            disk.add(k, p, demoted)

    def _forget_if_gone(self, key: bytes) -> None:
        if not self.has(key):
            self.parent.pop(key, None)

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
    for k in doomed:
        s.dram.remove(k)
        if s.disk is not None:
            s.disk.remove(k)
        s._forget_if_gone(k)
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
    sims = {i: SimNode(dram, disk, policy, probation, marginal_start, upper_tiers) for i in ids}
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
