"""A node replaced as an operator replaces one (issue 33, scenario S5): three daemons (replicas
2, etcd membership, each on its own disk; network namespaces when root, loopback otherwise)
under a byte-verified client load (4-block prompts written, earlier blocks read back and
compared), a baseline, then one node killed with -9 and a new daemon with an empty disk put in
its place: on the same address with the same node name (``new_id=False``), or on a new address
with a new name (``new_id=True``, a new machine). Recorded per second from the kill: reads and
hits (and hits among the blocks that still have a copy: every block acknowledged with 2 copies,
or written after the kill), the fewest nodes in the client's view; per write, the copies each
block got and whether the replacement was in the view when it began. Afterwards: how many
acknowledged blocks the surviving nodes and the replacement hold under 2 copies once repair
back-filled (``census``). Used by tests/cluster/test_cluster_replace.py (bounded) and
bench/replace.py (the measurement)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from cluster.chaos_run import NBYTES, ChaosNode
from cluster.cluster_etcd import Etcd
from cluster.cluster_hosts import NS as HOST_NS
from cluster.cluster_hosts import OPERATOR_TOKEN, TENANT, TENANT_NS, TOKEN
from cluster.cluster_netns import Net
from ports import free_port
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.results import Status

REPLICAS = 2


@dataclass
class Acked:
    key: object
    payload: bytes
    at: float
    copies: int


@dataclass
class Second:
    """What the load saw in one second (counted from the kill)."""

    reads: int = 0
    hits: int = 0
    reads_held: int = 0  # reads of blocks that still have a copy somewhere
    hits_held: int = 0
    min_view: int = 99
    blocks_written: int = 0
    under_replicated: int = 0  # blocks acknowledged with 1 copy in this second


@dataclass
class ReplaceResult:
    mode: str
    new_id: bool
    baseline_reads: int = 0
    baseline_hits: int = 0
    seconds: dict[int, Second] = field(default_factory=dict)
    wrong: int = 0
    back_after_s: float | None = None  # from the kill until the replacement was in the view
    min_view: int = 99  # the fewest nodes in the client's view at any moment of the run
    writes_after_back: int = 0  # blocks whose put began with the replacement in the view
    single_copy_after_back: int = 0  # ... and were acknowledged with fewer than 2 copies
    dropped_after_back: int = 0  # ... and were stored nowhere
    misses_held: int = 0  # reads that missed a block that still had a copy
    under_2_after_settle: int | None = None
    settle_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    listed: int = 0  # blocks the operator's listings returned
    listing_errors: int = 0
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def baseline(self) -> float:
        return self.baseline_hits / max(1, self.baseline_reads)

    def ratio(self, s: Second, held: bool = False) -> float | None:
        reads, hits = (s.reads_held, s.hits_held) if held else (s.reads, s.hits)
        return None if not reads or not self.baseline else hits / reads / self.baseline

    def line(self) -> str:
        worst = min((r for s in self.seconds.values() if (r := self.ratio(s)) is not None), default=None)
        return (
            f"{self.mode} {'new id' if self.new_id else 'same id'}: baseline hit rate {self.baseline:.3f} "
            f"({self.baseline_reads} reads); worst second {worst if worst is None else round(worst, 3)} of it; "
            f"back in the view {self.back_after_s and round(self.back_after_s, 1)} s after the kill; fewest nodes "
            f"in the view {self.min_view}; {self.single_copy_after_back} of {self.writes_after_back} blocks "
            f"written once back under {REPLICAS} copies ({self.dropped_after_back} nowhere); {self.misses_held} "
            f"misses of blocks with a copy; wrong bytes {self.wrong}; under {REPLICAS} copies after settling: "
            f"{self.under_2_after_settle} ({self.settle_s:.0f} s); {self.listed} blocks listed meanwhile "
            f"({self.listing_errors} listing errors); load average {self.load_avg}"
        )


class Replace:
    """The cluster, the load and the replacement of one run (see the module doc)."""

    def __init__(
        self,
        workdir: Path,
        use_netns: bool,
        new_id: bool,
        seed: int = 0,
        nbytes: int = NBYTES,
        preload: int = 0,
        gap_s: float = 0.0,
        listings: bool = True,
    ) -> None:
        """``nbytes``: each block's payload; ``preload``: blocks written before the baseline
        (what the replacement must be back-filled with); ``gap_s``: seconds between the kill
        and the replacement's start (past the 2 s lease, the old member leaves first);
        ``listings``: from the kill on, an operator watches the back-fill by paging through
        every member's blocks (``GET /v1/blocks``, 10,000 a page, what ``kvstore ls`` does) in
        a loop: the listings that stalled the data ports in the S5 report."""
        self.workdir = workdir
        self.new_id = new_id
        self.nbytes, self.preload, self.gap_s, self.listings = nbytes, preload, gap_s, listings
        self.rnd = random.Random(seed)
        self.net = Net() if use_netns else None
        self.etcd = Etcd(_mkdir(workdir / "etcd"), self.net.gateway if self.net else "127.0.0.1")
        self.url = self.etcd.url("replace")
        self.token_file = workdir / "tokens"
        self.token_file.write_text(f"{TOKEN} {TENANT}\n{OPERATOR_TOKEN} *\n")
        self.nodes = [self._node(f"n{i}", f"node-{i}") for i in range(3)]
        self.ns = TENANT_NS if self.net else HOST_NS
        auth = {"token": TOKEN, "tenant": TENANT} if self.net else {}
        self.client_cfg = ClientConfig(
            namespaces=(self.ns,), op_timeout_s=2.0, connect_timeout_s=0.5, probe_interval_s=0.1, **auth
        )
        self.acked: list[Acked] = []
        self.victim = 2
        self.replacement: ChaosNode | None = None
        self.result = ReplaceResult("netns" if self.net else "loopback", new_id)
        self._t_kill: float | None = None
        self._t_back: float | None = None
        self._seed = 1000 * seed

    def _node(self, dirname: str, name: str, like: ChaosNode | None = None) -> ChaosNode:
        """A node on a new host (new port on loopback), or on ``like``'s address."""
        if like is not None:
            host, port = like.host, like.port
        else:
            host = self.net.add_host() if self.net else None
            port = free_port()
        return ChaosNode(self.workdir / dirname, port, host, self.token_file, join=self.url, name=name)

    def start(self) -> None:
        self.etcd.start()
        for n in self.nodes:
            n.start()

    def close(self) -> None:
        for n in [*self.nodes, *([self.replacement] if self.replacement else [])]:
            n.stop()
        self.etcd.stop()
        if self.net is not None:
            self.net.teardown()

    def _second(self, now: float) -> Second | None:
        if self._t_kill is None:
            return None
        return self.result.seconds.setdefault(int(now - self._t_kill), Second())

    async def watch_view(self, c: ClusterClient, stop: asyncio.Event) -> None:
        """The client's view, sampled: its fewest nodes per second and when the replacement
        joined it."""
        while not stop.is_set():
            live = c.live_addrs()
            now = time.monotonic()
            if self._t_kill is not None:
                self.result.min_view = min(self.result.min_view, len(live))
                s = self._second(now)
                s.min_view = min(s.min_view, len(live))
                r = self.replacement
                if self._t_back is None and r is not None and r.daemon is not None and r.addr in live:
                    self._t_back = now
                    self.result.back_after_s = now - self._t_kill
            await asyncio.sleep(0.02)

    async def operator(self, stop: asyncio.Event) -> None:
        """Page through every member's blocks, again and again, until ``stop`` (counted in
        ``result.listed``; a member that does not answer is skipped)."""
        headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"} if self.net else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as s:
            while not stop.is_set():
                for n in self.members():
                    if n.daemon is None or stop.is_set():
                        continue
                    host = n.host.ip if n.host else "127.0.0.1"
                    url = f"http://{host}:{n.daemon.ports['admin_port']}/v1/blocks"
                    after = None
                    try:
                        while not stop.is_set():
                            q = {"limit": "10000", **({"after": after} if after else {})}
                            async with s.get(url, params=q) as r:
                                page = await r.json()
                            self.result.listed += len(page["blocks"])
                            after = page["next"]
                            if after is None:
                                break
                    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                        self.result.listing_errors += 1
                await asyncio.sleep(0.2)

    def _held(self, a: Acked) -> bool:
        """Whether ``a`` still has a copy: 2 acknowledged copies (on distinct nodes, so one
        survives), or written after the kill (only to nodes that are up)."""
        return a.copies >= REPLICAS or (self._t_kill is not None and a.at > self._t_kill)

    async def load(
        self, c: ClusterClient, stop: asyncio.Event, read_deadline_s: float, write_deadline_s: float
    ) -> None:
        """Write 4-block prompts and read back 8 earlier blocks per round, bytes compared."""
        r = self.result
        while not stop.is_set():
            self._seed += 1
            blocks = make_blocks(4, self.nbytes, seed=self._seed, ns=self.ns)
            back = self._t_back is not None
            rep = await c.put(blocks, write_deadline_s)
            now = time.monotonic()
            s = self._second(now)
            for (h, p), copies in zip(blocks, rep.copies):
                if copies >= 1:
                    self.acked.append(Acked(h.key, p, now, copies))
                if s is not None:
                    s.blocks_written += 1
                    s.under_replicated += copies < REPLICAS
                if back:
                    r.writes_after_back += 1
                    r.single_copy_after_back += copies < REPLICAS
                    r.dropped_after_back += copies == 0
            if self.acked:
                sample = self.rnd.sample(self.acked, min(8, len(self.acked)))
                bufs = [bytearray(self.nbytes) for _ in sample]
                async with c.read([a.key for a in sample], bufs, None, read_deadline_s) as got:
                    now = time.monotonic()
                    s = self._second(now)
                    for a, res, view in zip(sample, got.results, got.views):
                        hit = res.status is Status.HIT
                        if hit:
                            r.wrong += bytes(view) != a.payload
                        if s is None:
                            r.baseline_reads += 1
                            r.baseline_hits += hit
                            continue
                        s.reads += 1
                        s.hits += hit
                        if self._held(a):
                            s.reads_held += 1
                            s.hits_held += hit
                            r.misses_held += not hit
            await asyncio.sleep(0.02)

    async def replace(self) -> None:
        """kill -9 the victim; its replacement (empty disk) starts in its place."""
        old = self.nodes[self.victim]
        self._t_kill = time.monotonic()
        old.kill9()
        await asyncio.sleep(self.gap_s)
        if self.new_id:
            self.replacement = self._node("n3", "node-3")
        else:
            self.replacement = self._node(f"n{self.victim}-new", f"node-{self.victim}", like=old)
        await asyncio.to_thread(self.replacement.start)

    async def run(
        self,
        baseline_s: float,
        after_s: float,
        settle_s: float = 0.0,
        read_deadline_s: float = 2.0,
        write_deadline_s: float = 2.0,
    ) -> ReplaceResult:
        """``baseline_s`` of load, the replacement, ``after_s`` more once the replacement is
        in the client's view (at most 60 s waiting for that), then the census (``settle_s``:
        the most seconds repair gets to put back second copies; 0: no census)."""
        c = ClusterClient.etcd(self.url, self.client_cfg, ClusterConfig(replicas=REPLICAS))
        await c.start(10.0)
        await self._preload(c)
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(self.watch_view(c, stop)),
            asyncio.create_task(self.load(c, stop, read_deadline_s, write_deadline_s)),
        ]
        try:
            await asyncio.sleep(baseline_s)
            if self.listings:
                tasks.append(asyncio.create_task(self.operator(stop)))
            await self.replace()
            end = time.monotonic() + 60.0
            while self._t_back is None and time.monotonic() < end:
                await asyncio.sleep(0.1)
            await asyncio.sleep(after_s)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            self.result.counters = {k: v for k, v in c.counters.items() if v}
            await c.close()
        if settle_s > 0:
            await self.census(settle_s)
        self.result.load_avg = tuple(round(x, 2) for x in os.getloadavg())
        return self.result

    async def _preload(self, c: ClusterClient) -> None:
        """``preload`` blocks, 64-block prompts, acknowledged as the load's are."""
        for off in range(0, self.preload, 64):
            self._seed += 1
            blocks = make_blocks(min(64, self.preload - off), self.nbytes, seed=self._seed, ns=self.ns)
            rep = await c.put(blocks, 30.0)
            now = time.monotonic()
            for (h, p), copies in zip(blocks, rep.copies):
                if copies >= 1:
                    self.acked.append(Acked(h.key, p, now, copies))

    def members(self) -> list[ChaosNode]:
        live = [n for i, n in enumerate(self.nodes) if i != self.victim]
        return [*live, *([self.replacement] if self.replacement else [])]

    async def _copies(self) -> list[int]:
        """Per acknowledged block, how many of the current members hold it."""
        keys = [a.key for a in self.acked]
        out = [0] * len(keys)
        for n in self.members():
            c = NodeClient(n.addr, self.client_cfg)
            try:
                for off in range(0, len(keys), 4096):
                    tiers = (await c.lookup(keys[off : off + 4096], 10.0)).names()
                    for j, t in enumerate(tiers):
                        out[off + j] += t is not None
            finally:
                await c.close()
        return out

    async def census(self, settle_s: float) -> None:
        """Wait (at most ``settle_s``) for every block that still has a copy to have 2."""
        t0 = time.monotonic()
        while True:
            copies = await self._copies()
            under = sum(1 for a, k in zip(self.acked, copies) if k < REPLICAS and (k or self._held(a)))
            if under == 0 or time.monotonic() - t0 > settle_s:
                break
            await asyncio.sleep(1.0)
        self.result.settle_s = time.monotonic() - t0
        self.result.under_2_after_settle = under

    def counts(self) -> Counter[str]:
        return Counter(self.result.counters)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
