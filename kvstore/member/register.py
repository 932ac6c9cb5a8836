"""A daemon's registration in etcd (``kvstore serve --join etcd://host:port/CLUSTER``).

Contract: :class:`Registration` grants a lease of ``ttl_s`` seconds, puts this node's
:class:`Member` record under ``/tierkv/clusters/CLUSTER/nodes/<addr>`` with it, and renews it
every ``ttl_s / 3``. When etcd is away it retries with backoff; when the lease was lost (etcd
restarted past the TTL, or it expired) it registers again with a new one. ``stop()`` revokes
the lease so the node leaves at once. etcd trouble is logged, never fatal to the daemon: the
node keeps serving whoever already knows it.

:func:`kvstore.daemon.member.serve_member` runs the daemon with registration around it. The
client side, reading the members, is kvstore/client/etcd_membership.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter

from kvstore.client.etcd import EtcdClient, EtcdError, EtcdTarget, parse_etcd_url
from kvstore.client.etcd_security import EtcdSecurity
from kvstore.client.membership import Member, MembershipError
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.member.passes import stop_task

log = logging.getLogger("kvstore.member.register")


class Registration:
    def __init__(
        self, target: EtcdTarget, member: Member, ttl_s: int = 5, security: EtcdSecurity | None = None
    ) -> None:
        if ttl_s < 2:
            raise ConfigError(f"cluster.lease_ttl_s must be >= 2, got {ttl_s}")
        self.target = target
        self.member = member
        self.ttl_s = ttl_s
        self.client = EtcdClient(target.endpoints, timeout_s=max(1.0, ttl_s / 3), security=security)
        self.lease = 0
        self.counters: Counter[str] = Counter()
        self.registered = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def key(self) -> str:
        return self.target.prefix + self.member.addr

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _register(self) -> None:
        self.lease = await self.client.grant(self.ttl_s)
        await self.client.put(self.key, self.member.to_json(), self.lease)
        self.counters["registrations"] += 1
        self.registered.set()
        log.info("event=cluster_registered key=%s lease=%x ttl_s=%d", self.key, self.lease, self.ttl_s)

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                    backoff = 0.2
                await asyncio.sleep(self.ttl_s / 3)
                if await self.client.keepalive(self.lease) <= 0:
                    log.warning("event=cluster_lease_lost lease=%x", self.lease)
                    self.counters["leases_lost"] += 1
                    self.registered.clear()
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                log.warning("event=cluster_etcd_unavailable error=%r", str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.ttl_s / 3)

    async def stop(self) -> None:
        """Stop renewing and revoke the lease (best effort: etcd may be away)."""
        await stop_task(self._task)
        if self.registered.is_set():
            try:
                await self.client.revoke(self.lease)
            except EtcdError as exc:
                log.warning("event=cluster_revoke_failed error=%r", str(exc))
        await self.client.close()


def member_of(cfg: StoreConfig, host: str, data_port: int, admin_port: int = 0) -> Member:
    """This node's record: ``cluster.advertise`` or the bound address; capacity = DRAM + disk;
    the admin address on the same host (for the inspection CLI's ``--cluster``)."""
    addr = cfg.cluster.advertise or f"{host}:{data_port}"
    if not cfg.cluster.advertise and host in ("0.0.0.0", "::", ""):
        raise ConfigError("cluster.advertise: required when server.host is a wildcard address")
    capacity = cfg.dram.capacity + (cfg.disk.capacity if cfg.disk.enabled else 0)
    try:
        admin = f"{addr.rpartition(':')[0]}:{admin_port}" if admin_port else ""
        return Member(addr, capacity, cfg.node.zone, cfg.node.name or socket.gethostname(), admin)
    except MembershipError as exc:
        raise ConfigError(f"cluster.advertise: {exc}") from exc


def target_of(cfg: StoreConfig) -> EtcdTarget:
    try:
        return parse_etcd_url(cfg.cluster.join)
    except MembershipError as exc:
        raise ConfigError(f"cluster.join: {exc}") from exc
