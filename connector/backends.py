"""Where the connector's blocks live: an in-process node (``local://``) or storage daemons
(``kvstore://``, ``etcd://``), behind one small batched interface.

Contract (both): ``exists``, ``get_into`` and ``put`` never raise for a store problem — a
failure is a miss (``None`` / a non-HIT status) or a dropped write; every call honours its
deadline. Tier names are the node's (``dram``, ``disk``), prefixed ``remote:`` for daemons.
Bound to the event loop of their first call.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from connector.config import ConnectorConfig
from kvstore.block import BlockHeader
from kvstore.keys import BlockKey, Namespace
from kvstore.results import Expect, GetResult, PutResult, Status

log = logging.getLogger("tierkv.connector")


class Backend:
    async def tenant_namespace(self, base: Namespace, deadline_s: float) -> Namespace | None:
        """``base`` salted as the store salts this tenant's keys; None when the store cannot
        say now. An in-process store has no tenants."""
        return base

    async def start(self, deadline_s: float) -> None:
        """Open what the first call would otherwise open (the store, connections), within
        ``deadline_s``. Never raises for a store problem."""

    async def exists(self, keys: Sequence[BlockKey], deadline_s: float) -> list[str | None]:
        raise NotImplementedError

    async def get_into(
        self, keys: Sequence[BlockKey], bufs: Sequence[Any], expect: Sequence[Expect], deadline_s: float
    ) -> list[GetResult]:
        raise NotImplementedError

    async def put(self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float) -> list[PutResult]:
        raise NotImplementedError

    async def put_counted(
        self, blocks: Sequence[tuple[BlockHeader, Any]], deadline_s: float
    ) -> tuple[list[PutResult], int]:
        """:meth:`put`, and how many of the stored blocks have fewer copies than wanted."""
        return await self.put(blocks, deadline_s), 0

    async def get_views(
        self, keys: Sequence[BlockKey], expect: Sequence[Expect], deadline_s: float
    ) -> tuple[list[GetResult], list[Any], Callable[[], None]] | None:
        """Zero-copy reads where the store shares this process: per key a result and a
        read-only view of the payload in place (valid until ``release()`` is called). None when
        the backend cannot (the caller falls back to :meth:`get_into`)."""
        return None

    async def close(self) -> None:
        pass


class LocalBackend(Backend):
    """An in-process :class:`kvstore.node.store.NodeStore` with DRAM + disk under ``cfg.target``,
    opened on first use (in the engine's event loop)."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self._node = None
        self._opening: asyncio.Lock | None = None

    async def _get(self):
        if self._node is None:
            from kvstore.config import load_store_config
            from kvstore.node.store import NodeStore

            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._node is None:
                    store_cfg = load_store_config(
                        None,
                        {
                            "node.name": "local",
                            "dram.capacity": self.cfg.dram_capacity,
                            "disk.path": os.path.join(self.cfg.target, "disk"),
                            "disk.capacity": self.cfg.disk_capacity,
                            "disk.sync": self.cfg.disk_sync,
                        },
                        env={},
                    )
                    self._node = await NodeStore.open(store_cfg)
        return self._node

    async def start(self, deadline_s: float) -> None:
        # Opening the node allocates its DRAM tier and opens LMDB: seconds for a large tier.
        # No deadline of its own: start waits for it, so the first request never does.
        await self._get()

    @property
    def node(self):
        return self._node

    async def exists(self, keys, deadline_s):
        try:
            node = await asyncio.wait_for(self._get(), deadline_s * 20)
            return await node.contains(keys)
        except Exception as exc:  # the cache path never raises to the engine
            log.warning("event=local_exists_failed error=%r", exc)
            return [None] * len(keys)

    async def get_into(self, keys, bufs, expect, deadline_s):
        try:
            node = await self._get()
            return await asyncio.wait_for(node.get_into(keys, bufs, expect), deadline_s)
        except Exception as exc:
            log.warning("event=local_get_failed error=%r", exc)
            return [GetResult(Status.ERROR)] * len(keys)

    async def get_views(self, keys, expect, deadline_s):
        """Leases of blocks in DRAM: each payload is read in its slot; ``release`` ends the
        leases. None when a block is on disk only (then :meth:`get_into` reads it, verified)."""
        try:
            node = await self._get()
            if any(t == "disk" for t in await node.contains(keys)):
                return None  # disk reads go into the caller's (reused, warm) staging buffers
            leases = await asyncio.wait_for(node.lease(keys, max(deadline_s, 1.0) * 4), deadline_s)
        except Exception as exc:
            log.warning("event=local_lease_failed error=%r", exc)
            return [GetResult(Status.ERROR)] * len(keys), [None] * len(keys), lambda: None
        results, views = [], []
        for key, exp, lease in zip(keys, expect, leases):
            if lease is None:
                results.append(GetResult(Status.MISS))
                views.append(None)
            elif not lease.header.matches(key, exp.parent, exp.token_bytes):
                results.append(GetResult(Status.MISMATCH, lease.header, lease.tier))
                views.append(None)
            else:
                results.append(GetResult(Status.HIT, lease.header, lease.tier))
                views.append(lease.view)
        return results, views, lambda: node.release([x for x in leases if x is not None])

    async def put(self, blocks, deadline_s):
        try:
            node = await self._get()
            return await asyncio.wait_for(node.put(blocks), deadline_s)
        except Exception as exc:
            log.warning("event=local_put_failed error=%r", exc)
            return [PutResult(Status.ERROR)] * len(blocks)

    async def close(self) -> None:
        if self._node is not None:
            await self._node.close()
            self._node = None


class RemoteBackend(Backend):
    """Storage daemons through the replicated :class:`kvstore.client.cluster.ClusterClient`
    (a static list for ``kvstore://``, etcd membership for ``etcd://``; ``replicas`` copies).
    The client keeps its own failure contract: misses and dropped writes, never exceptions."""

    def __init__(self, cfg: ConnectorConfig, namespace: Namespace) -> None:
        from kvstore.client.cluster import ClusterClient, ClusterConfig
        from kvstore.client.node import ClientConfig

        token = cfg.token
        if cfg.token_file and not token:
            with open(cfg.token_file) as f:
                token = f.read().split()[0]
        ccfg = ClientConfig(
            token=token,
            tenant=cfg.tenant or None,
            namespaces=(namespace,),
            op_timeout_s=max(cfg.load_deadline_s, cfg.save_deadline_s),
        )
        cluster = ClusterConfig(replicas=cfg.replicas)
        if cfg.kind == "etcd":
            from kvstore.client.membership import MembershipError
            from kvstore.errors import ConfigError

            try:
                self.client = ClusterClient.etcd(f"etcd://{cfg.target}", ccfg, cluster)
            except MembershipError as exc:
                raise ConfigError(f"--kv-connector etcd://{cfg.target}: {exc}") from exc
        else:
            self.client = ClusterClient.static(cfg.addrs, ccfg, cluster)

    async def start(self, deadline_s: float) -> None:
        """Membership, then every connection of every node's pool, opened now (the cluster
        client's ``start``): a connection costs a TCP handshake, HELLO (auth, tenant salt) and,
        with RDMA, a device probe and a queue-pair exchange."""
        await self.client.start(deadline_s)

    async def tenant_namespace(self, base, deadline_s):
        """The salt the daemons hand out at HELLO (:func:`kvstore.client.node.tenant_namespace`)."""
        from kvstore.client.node import tenant_namespace

        return await tenant_namespace(list(self.client.nodes.values()), base, deadline_s)

    async def exists(self, keys, deadline_s):
        tiers = await self.client.exists(keys, deadline_s)
        return [f"remote:{t}" if t else None for t in tiers]

    async def get_into(self, keys, bufs, expect, deadline_s):
        return await self.client.get_into(keys, bufs, expect, deadline_s)

    async def put(self, blocks, deadline_s):
        return await self.client.put(blocks, deadline_s)

    async def put_counted(self, blocks, deadline_s):
        report = await self.client.put_report(blocks, deadline_s)
        return report.results, report.under_replicated

    async def close(self) -> None:
        await self.client.close()


def make_backend(cfg: ConnectorConfig, namespace: Namespace) -> Backend:
    if cfg.kind == "local":
        return LocalBackend(cfg)
    return RemoteBackend(cfg, namespace)  # kvstore:// (static list) or etcd:// (membership)
