"""A chaos run (issue 33): three real daemons in a static cluster (replicas 2, node-side repair
and orphan passes on, each on its own disk), a byte-verified write/read load through the
cluster client, and faults on one node at a time: kill -9 (restarted on its own disk),
SIGSTOP (then SIGCONT), a clean restart, a partition (network namespaces only: the host's
link down, then up) and a wipe (kill -9, disk removed, started empty on the same address).
Then everything heals, repair is given time to settle, and a census reads every
acknowledged block from every node: lost (held nowhere) and wrong bytes. A loss is excused
only when a wipe destroyed the block's last copy (right before each wipe every node is asked
which acknowledged blocks it holds, and a block held by the wiped node alone then is one), or
the block's parent is such a loss (its chain is unreachable: the orphan pass drops it). Used by tests/cluster/test_cluster_chaos.py (bounded) and bench/chaos.py
(long, one fault type at a time)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cluster.cluster_hosts import NS as HOST_NS
from cluster.cluster_hosts import OPERATOR_TOKEN, TENANT, TENANT_NS, TOKEN
from cluster.cluster_netns import Host, Net
from daemonutil import REPO, Daemon, _toml, wait_serving
from ports import free_port
from storeutil import make_blocks

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

FAULTS = ("kill9", "sigstop", "restart", "partition", "wipe")
NBYTES = 4096


class ChaosNode:
    """One daemon on a fixed address (a namespaced host, or loopback when ``host`` is None)
    that can be killed, stopped, partitioned, wiped and started again on the same address."""

    def __init__(
        self, wd: Path, port: int, host: Host | None, token_file: Path | None, join: str = "", name: str = ""
    ) -> None:
        """``join``: an etcd URL (membership by registration, lease 2 s) instead of the static
        ``peers``; ``name``: the node's ``node.name`` (its id; the host name when empty)."""
        self.wd, self.port, self.host, self.token_file = wd, port, host, token_file
        self.join, self.name = join, name
        self.daemon: Daemon | None = None  # the running process, None before the first start
        self.peers: list[str] = []

    @property
    def addr(self) -> str:
        return f"{self.host.ip if self.host else '127.0.0.1'}:{self.port}"

    def start(self) -> None:
        self.wd.mkdir(parents=True, exist_ok=True)
        cfg: dict[str, dict] = {
            "dram": {"capacity": "32MiB", "slab_size": "1MiB"},
            "disk": {"enabled": True, "path": str(self.wd / "disk"), "capacity": "256MiB", "sync": False},
            "server": {"data_port": self.port, "port_file": str(self.wd / "ports.json")},
            "cluster": {"join": self.join, "lease_ttl_s": 2} if self.join else {"peers": self.peers},
            "repair": {"replicas": 2, "interval_s": 1.0, "settle_s": 0.2, "batch_keys": 64},
        }
        if self.name:
            cfg["node"] = {"name": self.name}
        if self.host is not None:
            cfg["server"]["host"] = self.host.ip
            cfg["auth"] = {"token_file": str(self.token_file)}
        text = "".join(
            f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in vals.items()) for s, vals in cfg.items()
        )
        (self.wd / "node.toml").write_text(text)
        (self.wd / "ports.json").unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(self.wd / "node.toml")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        log = self.wd / "daemon.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.host.cmd(*argv) if self.host else argv,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.daemon = Daemon(proc, wait_serving(proc, self.wd / "ports.json", log), self.wd, log)

    def signal(self, sig: int) -> None:
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.signal(sig)

    def kill9(self) -> None:
        if self.daemon is not None:
            self.signal(signal.SIGCONT)
            self.daemon.kill9()

    def stop(self) -> None:
        if self.daemon is not None:
            self.signal(signal.SIGCONT)  # SIGTERM waits in a stopped process's queue
            self.daemon.stop(30)

    def wipe(self) -> None:
        shutil.rmtree(self.wd / "disk", ignore_errors=True)


@dataclass
class Acked:
    key: object
    parent: object
    payload: bytes
    at: float
    copies: int


@dataclass
class ChaosResult:
    mode: str
    faults: Counter = field(default_factory=Counter)
    acked: int = 0
    acked_2: int = 0
    lost: int = 0
    lost_excused: int = 0
    lost_by_last_fault: Counter = field(default_factory=Counter)
    wrong: int = 0
    reads: int = 0
    read_hits: int = 0
    under_2_after_settle: int = 0
    held_below_a_lost_block: int = 0  # still stored, unreachable: an ancestor is held nowhere
    settle_s: float = 0.0

    def line(self) -> str:
        return (
            f"{self.mode}: faults {dict(self.faults)}; {self.acked} blocks acknowledged ({self.acked_2} with 2 "
            f"copies); lost {self.lost} ({self.lost_excused} by a wipe of their last copy or of a parent's), by the fault after "
            f"their acknowledgment {dict(self.lost_by_last_fault)}; wrong bytes {self.wrong}; reads "
            f"{self.read_hits}/{self.reads} hit; {self.under_2_after_settle} under 2 copies after "
            f"{self.settle_s:.0f} s of settling; {self.held_below_a_lost_block} still held below a lost block"
        )


def _cut_off(holders: list[list[int]], parents: list[int | None]) -> list[bool]:
    """Per block (parents listed before their children), whether an ancestor is held nowhere."""
    cut = [False] * len(holders)
    for j, p in enumerate(parents):
        cut[j] = p is not None and (not holders[p] or cut[p])
    return cut


class Chaos:
    """The cluster, the load and the faults of one run (see the module doc)."""

    def __init__(self, workdir: Path, use_netns: bool, seed: int = 0) -> None:
        self.rnd = random.Random(seed)  # the faults: the same seed, the same sequence
        self.load_rnd = random.Random(seed + 1)
        self.net = Net() if use_netns else None
        token_file = workdir / "tokens"
        token_file.write_text(f"{TOKEN} {TENANT}\n{OPERATOR_TOKEN} *\n")
        self.nodes: list[ChaosNode] = []
        for i in range(3):
            host = self.net.add_host() if self.net else None
            self.nodes.append(ChaosNode(workdir / f"n{i}", free_port(), host, token_file))
        for n in self.nodes:
            n.peers = [m.addr for m in self.nodes]
        self.ns = TENANT_NS if self.net else HOST_NS
        auth = {"token": TOKEN, "tenant": TENANT} if self.net else {}
        self.client_cfg = ClientConfig(namespaces=(self.ns,), op_timeout_s=2.0, connect_timeout_s=0.5, **auth)
        self.acked: list[Acked] = []
        self.excused: set[int] = set()  # acknowledged blocks whose last copy a wipe destroyed
        self.history: list[tuple[float, str]] = []  # (when a fault began, its kind)
        self.result = ChaosResult("netns" if self.net else "loopback")
        self._seed = 1000 * seed

    def kinds(self) -> tuple[str, ...]:
        return FAULTS if self.net else tuple(k for k in FAULTS if k != "partition")

    def start(self) -> None:
        for n in self.nodes:
            n.start()

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        if self.net is not None:
            self.net.teardown()

    async def _answers(self, n: ChaosNode) -> bool:
        c = NodeClient(n.addr, self.client_cfg)
        try:
            return await c.stats(1.0) is not None
        finally:
            await c.close()

    async def fault(self, kind: str, i: int, hold_s: float) -> None:
        """One fault on node ``i`` for about ``hold_s``, then undone; returns once it answers."""
        n = self.nodes[i]
        self.result.faults[kind] += 1
        self.history.append((time.monotonic(), kind))
        if kind == "kill9":
            n.kill9()
            await asyncio.sleep(hold_s)
            await asyncio.to_thread(n.start)
        elif kind == "wipe":
            for j, h in enumerate(await self._holders()):
                if h == [i]:
                    self.excused.add(j)
            n.kill9()
            n.wipe()
            await asyncio.sleep(hold_s)
            await asyncio.to_thread(n.start)
        elif kind == "restart":
            await asyncio.to_thread(n.stop)
            await asyncio.to_thread(n.start)
        elif kind == "sigstop":
            n.signal(signal.SIGSTOP)
            await asyncio.sleep(hold_s)
            n.signal(signal.SIGCONT)
        elif kind == "partition":
            assert self.net is not None and n.host is not None
            self.net.partition(n.host)
            await asyncio.sleep(hold_s)
            self.net.heal(n.host)
        end = time.monotonic() + 60
        while not await self._answers(n) and time.monotonic() < end:
            await asyncio.sleep(0.2)

    async def load(self, c: ClusterClient, stop: asyncio.Event) -> None:
        """Write 4-block prompts and read back earlier ones, bytes compared, until ``stop``."""
        while not stop.is_set():
            self._seed += 1
            blocks = make_blocks(4, NBYTES, seed=self._seed, ns=self.ns)
            rep = await c.put(blocks, 2.0)
            now = time.monotonic()
            for (h, p), copies in zip(blocks, rep.copies):
                if copies >= 1:
                    self.acked.append(Acked(h.key, h.parent, p, now, copies))
            if self.acked:
                sample = self.load_rnd.sample(self.acked, min(8, len(self.acked)))
                bufs = [bytearray(NBYTES) for _ in sample]
                res = await get_into(c, [a.key for a in sample], bufs, None, 1.0)
                for a, r, b in zip(sample, res, bufs):
                    self.result.reads += 1
                    if r.status is Status.HIT:
                        self.result.read_hits += 1
                        self.result.wrong += bytes(b) != a.payload
            await asyncio.sleep(0.05)

    async def run(
        self, seconds: float, kinds: tuple[str, ...] | None = None, settle_s: float = 60.0
    ) -> ChaosResult:
        kinds = kinds or self.kinds()
        c = ClusterClient.static([n.addr for n in self.nodes], self.client_cfg, ClusterConfig(replicas=2))
        await c.start(5.0)
        stop = asyncio.Event()
        load = asyncio.create_task(self.load(c, stop))
        try:
            end = time.monotonic() + seconds
            await asyncio.sleep(1.0)
            while time.monotonic() < end:
                await self.fault(self.rnd.choice(kinds), self.rnd.randrange(3), self.rnd.uniform(1.5, 4.0))
                await asyncio.sleep(self.rnd.uniform(1.0, 3.0))
        finally:
            stop.set()
            await load
            await c.close()
        await self.census(settle_s)
        return self.result

    async def _holders(self) -> list[list[int]]:
        """Per acknowledged block (so far), the nodes that hold it now (one that does not
        answer holds nothing here: a census waits for every node to answer first)."""
        keys = [a.key for a in self.acked]
        out: list[list[int]] = [[] for _ in keys]
        for i, n in enumerate(self.nodes):
            c = NodeClient(n.addr, self.client_cfg)
            try:
                for off in range(0, len(keys), 4096):
                    tiers = (await c.lookup(keys[off : off + 4096], 10.0)).names()
                    for j, t in enumerate(tiers):
                        if t is not None:
                            out[off + j].append(i)
            finally:
                await c.close()
        return out

    async def census(self, settle_s: float) -> None:
        r = self.result
        r.acked = len(self.acked)
        r.acked_2 = sum(a.copies >= 2 for a in self.acked)
        index = {a.key: j for j, a in enumerate(self.acked)}
        parents = [index.get(a.parent) for a in self.acked]
        t0 = time.monotonic()
        while True:  # repair's time to put back the second copies
            holders = await self._holders()
            cut = _cut_off(holders, parents)
            # a block whose last copy a wipe destroyed cannot come back, and one below a block
            # held nowhere is unreachable (the orphan pass's to drop): neither is waited for
            under = sum(
                len(h) < 2 and not cut[j] and (bool(h) or j not in self.excused)
                for j, h in enumerate(holders)
            )
            if under == 0 or time.monotonic() - t0 > settle_s:
                break
            await asyncio.sleep(1.0)
        r.settle_s = time.monotonic() - t0
        r.under_2_after_settle = under
        r.held_below_a_lost_block = sum(bool(h) and cut[j] for j, h in enumerate(holders))
        gone: set[int] = set()  # lost and excused: a wipe took the last copy, or its parent's
        for j, (a, h) in enumerate(zip(self.acked, holders)):  # parents before their children
            if not h:
                r.lost += 1
                parent = index.get(a.parent)
                if j in self.excused or (parent is not None and parent in gone):
                    # a child of a block no node holds is unreachable (a lookup stops at the
                    # missing parent): the orphan pass may drop it, by design
                    gone.add(j)
                    r.lost_excused += 1
                last = [k for t, k in self.history if t > a.at]
                r.lost_by_last_fault[last[0] if last else "none"] += 1
        for i, n in enumerate(self.nodes):  # every copy read back, bytes compared
            mine = [(a, i) for a, h in zip(self.acked, holders) if i in h]
            c = NodeClient(n.addr, self.client_cfg)
            try:
                for off in range(0, len(mine), 256):
                    part = [a for a, _ in mine[off : off + 256]]
                    bufs = [bytearray(NBYTES) for _ in part]
                    res = await get_into(c, [a.key for a in part], bufs, None, 10.0)
                    for a, x, b in zip(part, res, bufs):
                        r.wrong += x.status is Status.HIT and bytes(b) != a.payload
            finally:
                await c.close()
