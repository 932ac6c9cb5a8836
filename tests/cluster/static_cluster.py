"""Static clusters on loopback. :class:`StaticCluster`, for the repair tests: every member's
address is known before any starts (``cluster.peers``), node-side repair runs quick passes,
and a node starts again on its own address (its disk kept, or wiped by the test first).
:func:`dram_cluster`: plain DRAM daemons and a static client over them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from daemonutil import Daemon
from ports import free_port
from storeutil import write_all

from kvstore.client.cluster import ClusterClient, ClusterConfig
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient

REPAIR = {"replicas": 2, "interval_s": 0.5, "settle_s": 0.1, "batch_keys": 64}


class StaticCluster:
    """``n`` members started by the ``start_daemon`` fixture, each under ``workdir/n<i>``."""

    def __init__(self, start_daemon: Callable[..., Daemon], workdir: Path, n: int = 3) -> None:
        self._start_daemon = start_daemon
        self.workdir = workdir
        self.ports = [free_port() for _ in range(n)]
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.daemons: list[Daemon] = []
        for i in range(n):
            self.daemons.append(self._launch(i))

    def _launch(self, i: int) -> Daemon:
        return self._start_daemon(
            workdir=self.workdir / f"n{i}",
            server={"data_port": self.ports[i]},
            cluster={"peers": self.addrs},
            repair=dict(REPAIR),
        )

    def start(self, i: int) -> Daemon:
        """Member ``i`` again, on its address and work dir (``daemons[i]`` is the new one)."""
        self.daemons[i] = self._launch(i)
        return self.daemons[i]


async def held(addr: str, keys, cfg: ClientConfig) -> list[bool]:
    """Per key whether the node at ``addr`` holds it (that it answered is asserted)."""
    n = NodeClient(addr, cfg)
    try:
        tiers = (await n.lookup(keys, 5.0)).names()
        assert n.up, f"{addr} did not answer"
        return [t is not None for t in tiers]
    finally:
        await n.close()


async def put_to(addr: str, blocks, cfg: ClientConfig) -> None:
    """Write ``blocks`` to the node at ``addr`` alone, each one stored (asserted)."""
    n = NodeClient(addr, cfg)
    try:
        await write_all(n, blocks, 10.0)
    finally:
        await n.close()


async def copies(addrs: list[str], keys, cfg: ClientConfig) -> list[int]:
    """How many of ``addrs`` hold each key (a node that does not answer holds none)."""
    out = [0] * len(keys)
    for a in addrs:
        n = NodeClient(a, cfg)
        try:
            for i, t in enumerate((await n.lookup(keys, 5.0)).names()):
                out[i] += t is not None
        finally:
            await n.close()
    return out


async def dram_cluster(
    start_daemon: Callable[..., Daemon],
    n: int,
    cfg: ClientConfig,
    cluster: ClusterConfig,
    start_s: float = 2.0,
) -> tuple[list[Daemon], ClusterClient]:
    """``n`` DRAM-only daemons (no cluster config of their own) and a static
    :class:`ClusterClient` over them (``cfg``, ``cluster``), started within ``start_s``."""
    ds = [start_daemon(use_disk=False) for _ in range(n)]
    c = ClusterClient.static([d.addr for d in ds], cfg, cluster)
    await c.start(start_s)
    return ds, c
