"""``kvstore serve`` for a cluster member: the daemon (kvstore/daemon/server.py) with, around
it, the member role (kvstore/member/): its etcd registration (``cluster.join``), its
anti-entropy repair (``repair.*``) and its orphan pass (``orphans.*``) over the static
``cluster.peers`` or the etcd membership.

Contract: :func:`serve_member` returns when the daemon stops (SIGTERM/SIGINT); the orphan pass
and the repair are stopped first (a pass under way leases the node's memory, which the
daemon's shutdown releases: a pass still running then failed on a released memoryview, issue
33), then the daemon shuts down, then the registration is revoked. The two passes share one
:class:`~kvstore.member.passes.PassRunner`: one background pass at a time on the node. A
configuration that cannot work (auth on and no operator token for the passes' peer sessions,
a bad peer address) is a ConfigError before anything serves.

It lives with the daemon, not in kvstore/member/: it composes the daemon and the member role,
and the member role never imports the daemon (tests/test_import_graph.py).
"""

from __future__ import annotations

import logging

from kvstore.client.membership import Membership, MembershipError, StaticMembership
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.daemon")


def operator_token(cfg: StoreConfig) -> str:
    """The token a node's repair presents to its peers: the first operator (``*``) entry of
    ``auth.token_file`` ("" without auth). ConfigError when auth is on and there is none."""
    if not cfg.auth.token_file:
        return ""
    from kvstore.daemon.auth import OPERATOR, TokenTable

    for token, tenant in TokenTable.load(cfg.auth.token_file).entries:
        if tenant == OPERATOR:
            return token
    raise ConfigError(
        "repair.enabled: auth.token_file has no operator ('*') token for the repair's peer "
        "sessions (add one, or set repair.enabled = false)"
    )


def repair_membership(cfg: StoreConfig, self_addr: str) -> Membership:
    """The members the repair places blocks over: etcd's (``cluster.join``) or the static
    ``cluster.peers`` (this node's address added when missing)."""
    if cfg.cluster.join:
        from kvstore.client.etcd_membership import EtcdMembership
        from kvstore.client.etcd_security import EtcdSecurity
        from kvstore.member.register import target_of

        return EtcdMembership(target_of(cfg), security=EtcdSecurity.of(cfg.cluster))
    peers = list(cfg.cluster.peers)
    if self_addr not in peers:
        peers.append(self_addr)
    try:
        return StaticMembership(peers)
    except MembershipError as exc:
        raise ConfigError(f"cluster.peers: {exc}") from exc


async def serve_member(cfg: StoreConfig) -> None:
    """Like ``kvstore.daemon.server.serve``, as a registered and self-repairing member."""
    from kvstore.client.etcd_security import EtcdSecurity
    from kvstore.daemon.server import Daemon
    from kvstore.member.orphans import OrphanPass
    from kvstore.member.passes import PassRunner
    from kvstore.member.register import Registration, member_of, target_of
    from kvstore.member.repair import Repair

    target = target_of(cfg) if cfg.cluster.join else None  # a bad URL fails before anything opens
    token = operator_token(cfg) if cfg.repair.enabled or cfg.orphans.enabled else ""
    daemon = await Daemon.start(cfg)
    daemon.install_signals()
    me = member_of(cfg, daemon.host, daemon.data_port, daemon.admin_port)
    reg = repair = orphans = None
    runner = PassRunner()
    try:
        if target is not None:
            reg = Registration(target, me, cfg.cluster.lease_ttl_s, EtcdSecurity.of(cfg.cluster))
            await reg.start()
        if cfg.repair.enabled:
            repair = Repair(daemon.node, me.addr, repair_membership(cfg, me.addr), cfg.repair, token, runner)
            repair.register_metrics(daemon.metrics.registry)
            await repair.start()
            log.info("event=repair_started node=%s replicas=%d", me.addr, cfg.repair.replicas)
        if cfg.orphans.enabled:
            orphans = OrphanPass(
                daemon.node, me.addr, repair_membership(cfg, me.addr), cfg.orphans, cfg.repair.replicas, token,
                settle_s=cfg.repair.settle_s, runner=runner,
            )  # fmt: skip
            orphans.register_metrics(daemon.metrics.registry)
            await orphans.start()
            daemon.orphans = orphans  # the admin route POST /v1/orphans/pass
        await daemon.stop_requested()
    finally:
        if orphans is not None:
            await orphans.close()
        if repair is not None:
            await repair.close()
        await daemon.shutdown()  # only now: no pass holds a lease on the node's memory
        if reg is not None:
            await reg.stop()
