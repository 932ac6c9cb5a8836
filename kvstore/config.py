"""The store's configuration: the sections of ``kvstore serve`` and the in-process node
(``local://``), read by the one config loader (:mod:`kvstore.settings`: TOML file, then
``TIERKV_*`` environment variables, then overrides and flags; a bad key or value is a
:class:`ConfigError` naming the key and its source). Every default is safe on a laptop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.errors import ConfigError

# the loader's names, importable from here too for the store's modules and tools
from kvstore.settings import Size, check_floor, coerce, format_size, load_config, parse_size  # noqa: F401


@dataclass(frozen=True)
class NodeSection:
    name: str = ""  # defaults to the host name at start
    promote_on_read: bool = True
    lease_ttl_s: float = 30.0
    zone: str = ""
    # RAM the tiers' indexes and in-memory headers may take (~1.1 KiB a block, at least that
    # for any block): past it a tier evicts or refuses, as at capacity (kvstore.node.tiers.ram)
    index_memory: Size = Size(512 * 1024**2)

    def __post_init__(self) -> None:
        if self.index_memory < 1024**2:
            raise ConfigError(f"node.index_memory: at least 1MiB, got {self.index_memory}")


@dataclass(frozen=True)
class DramSection:
    capacity: Size = Size(1024**3)  # reserved lazily: untouched pages cost nothing
    slab_size: Size = Size(32 * 1024**2)  # the largest block the tier takes
    pin: Literal["auto", "true", "false"] = "auto"  # page-lock via torch/CUDA when available
    prefault: bool = False  # fault the whole buffer in at start: full-speed first writes, RSS = capacity


@dataclass(frozen=True)
class DiskSection:
    enabled: bool = True
    path: str = ""  # required when enabled; no default path on purpose
    capacity: Size = Size(1024**3)
    map_size: Size = Size(0)  # 0: derived from capacity
    sync: bool = True  # fsync on commit: a durable ack survives power loss
    writemap: bool = False
    write_mode: Literal["write-through", "write-back"] = "write-through"


@dataclass(frozen=True)
class HbmSection:
    capacity: Size = Size(0)  # 0: tier off
    device: str = "cuda:0"
    slab_size: Size = Size(32 * 1024**2)


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    data_port: int = 0  # 0: an ephemeral port, printed at start
    admin_port: int = 0
    max_frame: Size = Size(64 * 1024**2)
    transport: Literal["auto", "tcp", "rdma"] = "auto"
    rdma_device: str = ""  # verbs device name (e.g. mlx5_0); empty: the first one
    rdma_gid_index: int = 0  # GID table index of port 1 (RoCE v2 is often 1 or 3; see show_gids)
    port_file: str = ""  # when set, the bound ports are written here as JSON at start

    def __post_init__(self) -> None:
        if not 0 <= self.rdma_gid_index < 256:
            raise ConfigError(f"server.rdma_gid_index: expected 0..255, got {self.rdma_gid_index}")


@dataclass(frozen=True)
class AuthSection:
    token_file: str = ""  # lines "token tenant"; empty: no auth, loopback only
    # a secret shared by every node of a cluster: tenant salts are HMACs of it, so no one can
    # compute another tenant's keys; empty with a token_file: salts are tenant names (not secret)
    salt_secret_file: str = ""


@dataclass(frozen=True)
class LimitsSection:
    """What one client may cost the daemon (docs/security.md). Every wait has a deadline: a
    peer past one loses its connection, and only its own."""

    hello_timeout_s: float = 10.0  # connect to HELLO answered; also bounds a pre-auth header
    idle_timeout_s: float = 900.0  # an authenticated connection with no request in flight
    transfer_timeout_s: float = 60.0  # one request's header and payload, in or out
    # the kernel's send buffer of a data connection (SO_SNDBUF; the kernel doubles it): what a
    # peer that stops reading holds of the node's memory, beside the replies queued
    send_buffer: Size = Size(1024**2)
    max_unauthenticated: int = 64  # open connections that have not passed HELLO
    max_conns_per_tenant: int = 256  # open authenticated connections per tenant
    # namespaces one tenant may hold on a node (declared by a live connection or holding
    # blocks): a HELLO past it is refused; the shares sum a tenant's bytes over them all
    max_namespaces_per_tenant: int = 256
    max_header_unauthenticated: Size = Size(64 * 1024)  # frame header before HELLO
    max_leases_per_conn: int = 4096  # LEASE + RESERVE handles one connection may hold
    max_lease_ttl_s: float = 300.0  # the longest LEASE ttl a client may ask for
    # msgpack objects in one decoded frame header, before HELLO and after: a header of tiny
    # objects (empty maps) costs ~64 bytes of memory per wire byte and the loop's time
    max_header_objects_unauthenticated: int = 2048
    max_header_objects: int = 65536  # a GET of 4096 keys with expects and caps: ~20,500
    # bytes of disk-only blocks one tenant's LEASEs hold at once (private copies and
    # promotions into DRAM): an idle lease cannot pin memory beyond its tenant's share
    max_leased_disk_bytes_per_tenant: Size = Size(256 * 1024**2)
    # the admin port (HTTP): open connections (past it the oldest of the busiest source is
    # closed), a request's header from accept or the previous reply, one request's body and
    # handler, and the largest body
    admin_max_connections: int = 64
    admin_header_timeout_s: float = 10.0
    admin_request_timeout_s: float = 30.0
    admin_max_body: Size = Size(1024**2)

    def __post_init__(self) -> None:
        timeouts = (
            "hello_timeout_s",
            "idle_timeout_s",
            "transfer_timeout_s",
            "max_lease_ttl_s",
            "admin_header_timeout_s",
            "admin_request_timeout_s",
        )
        check_floor("limits", self, 0, timeouts, strict=True)
        counts = (
            "max_unauthenticated",
            "max_conns_per_tenant",
            "max_namespaces_per_tenant",
            "max_leases_per_conn",
            "max_header_objects_unauthenticated",
            "max_header_objects",
            "admin_max_connections",
            "admin_max_body",
            "send_buffer",
        )
        check_floor("limits", self, 1, counts)
        if self.max_header_unauthenticated < 256:
            raise ConfigError(
                f"limits.max_header_unauthenticated: at least 256 bytes (a HELLO), got {self.max_header_unauthenticated}"
            )


@dataclass(frozen=True)
class ClusterSection:
    join: str = ""  # etcd://host:port/CLUSTER: register this node there (lease + keepalive)
    advertise: str = ""  # host:port clients dial; empty: server.host and the bound data port
    lease_ttl_s: int = 5  # a node that stops renewing leaves the membership after this
    # a static cluster: every member's data address (host:port), this node's included; its
    # repair (below) keeps the blocks it holds on their owners among them. Empty: not in a
    # static cluster (cluster.join is the etcd way)
    peers: tuple[str, ...] = ()
    # etcd over TLS and with a user (docs/cluster.md): CA bundle, client certificate and key
    # (PEM files), user name and a file holding the password; empty: plain HTTP, no auth
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""


@dataclass(frozen=True)
class RepairSection:
    """Node-side anti-entropy (docs/cluster.md): a node in a cluster (cluster.peers or
    cluster.join) walks its own blocks and pushes each to the owners that lack it."""

    enabled: bool = True
    replicas: int = 2  # copies the cluster keeps of every block (the clients' replicas)
    interval_s: float = 30.0  # a full pass at least this often
    settle_s: float = 2.0  # after a membership change, wait this long before a pass
    max_bytes_per_s: Size = Size(64 * 1024**2)  # pushed payload bytes per second at most
    batch_keys: int = 256  # keys per EXISTS to one owner
    deadline_s: float = 5.0  # each call to a peer

    def __post_init__(self) -> None:
        check_floor("repair", self, 1, ("replicas", "batch_keys"))
        check_floor("repair", self, 0, ("interval_s", "deadline_s", "max_bytes_per_s"), strict=True)
        check_floor("repair", self, 0, ("settle_s",))


@dataclass(frozen=True)
class OrphansSection:
    """The orphan pass (docs/cluster.md "Orphans"): a cluster member evicts its blocks whose
    parent is stored on none of the parent's owners (kvstore/member/orphans.py)."""

    enabled: bool = True
    interval_s: float = 5.0  # a pass this often (the orphans it bounds are what forms between two)
    batch_keys: int = 1024  # parents per EXISTS to one owner
    # blocks a pass handles between two yields to the event loop (at most batch_keys): a
    # slice of 128 costs ~0.3 ms of the loop, one of 1024 ~7 ms (bench/passes.py)
    slice_blocks: int = 128
    deadline_s: float = 5.0  # each call to a peer
    # ranks past a parent's owners also asked: the clients' lookahead (their lookups find a
    # block there, e.g. one written past a down owner), which a node cannot derive
    lookahead: int = 1
    # a member that left the view (maybe only unreachable: stalled past its etcd lease) counts
    # this long as holding the parents that rank on it: none is taken for absent meanwhile
    departed_s: float = 3600.0

    def __post_init__(self) -> None:
        check_floor("orphans", self, 1, ("batch_keys", "slice_blocks"))
        check_floor("orphans", self, 0, ("lookahead",))
        check_floor("orphans", self, 0, ("interval_s", "deadline_s", "departed_s"), strict=True)


@dataclass(frozen=True)
class TombstonesSection:
    """What a node remembers of its deletes (docs/cluster.md "Evictions that stick"), kept per
    deleting tenant: one tenant's deletes never end another's tombstone."""

    per_tenant: int = 65536  # tombstones per tenant; past it that tenant's oldest go
    max_age_s: float = 7 * 86400.0  # a tombstone older than this ends

    def __post_init__(self) -> None:
        check_floor("tombstones", self, 1, ("per_tenant",))
        check_floor("tombstones", self, 0, ("max_age_s",), strict=True)


@dataclass(frozen=True)
class EvictionSection:
    """Which blocks leave a tier first, and what one namespace may take from another
    (docs/storage.md "Eviction", docs/security.md "Per-tenant shares")."""

    policy: Literal["lru", "prefix-lru", "prefix-2q", "prefix-arc", "prefix-marginal"] = "prefix-marginal"
    probation: float = 0.1  # prefix-2q: the share of a tier's blocks new, unread ones may hold
    ghosts: float = 4.0  # prefix-2q: keys evicted from probation remembered, x blocks held
    # prefix-marginal: where its probation share starts (kvstore.node.tiers.order_marginal)
    marginal_start: float = 0.2
    # a namespace holding at most this share of a tier's bytes keeps them against another
    # namespace's writes (that namespace's own blocks go first); 0: no shares
    tenant_share: float = 0.25
    # the order of the memory tiers (hbm, dram) above a write-through disk: "policy"
    # (``policy`` in every tier) or "recency" (prefix-lru, or lru under policy lru: what they
    # evict is still on disk). Not "recency" by default: it gains a few per cent of hit tokens
    # on the traces but serves up to half as many of them from DRAM (docs/eviction-policy.md
    # "DRAM over a write-through disk keeping recency"); see tier_policy
    upper_tiers: Literal["recency", "policy"] = "policy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.probation < 1.0:
            raise ConfigError(f"eviction.probation: must be in [0, 1), got {self.probation}")
        if not 0.0 <= self.ghosts <= 64.0:
            raise ConfigError(f"eviction.ghosts: must be in [0, 64], got {self.ghosts}")
        if not 0.01 <= self.marginal_start <= 0.99:
            raise ConfigError(f"eviction.marginal_start: must be in [0.01, 0.99], got {self.marginal_start}")
        if not 0.0 <= self.tenant_share <= 1.0:
            raise ConfigError(f"eviction.tenant_share: must be in [0, 1], got {self.tenant_share}")
        if self.upper_tiers not in ("recency", "policy"):
            raise ConfigError(f"eviction.upper_tiers: must be recency or policy, got {self.upper_tiers!r}")

    def tier_policy(self, over_write_through_disk: bool) -> str:
        """The eviction order of one tier. ``policy``, except in a memory tier above a
        write-through disk under ``upper_tiers = "recency"``: every block it holds is on the
        disk too (or goes down to it when the disk has dropped it), so its evictions lose
        nothing and the node's scan resistance lives in the disk's order, while the memory
        tier keeps what was read last (prefix-aware unless ``policy`` is ``lru``). A read served
        from memory counts in the disk's order too (TierStack.touch), so a scan that flushes
        the memory tier leaves a prefix read from it on the disk.
        docs/eviction-policy.md "DRAM over a write-through disk keeping recency"."""
        if not over_write_through_disk or self.upper_tiers == "policy":
            return self.policy
        return "lru" if self.policy == "lru" else "prefix-lru"


@dataclass(frozen=True)
class StoreConfig:
    """The ``kvstore serve`` role and the in-process node (``local://``)."""

    node: NodeSection = field(default_factory=NodeSection)
    dram: DramSection = field(default_factory=DramSection)
    disk: DiskSection = field(default_factory=DiskSection)
    hbm: HbmSection = field(default_factory=HbmSection)
    server: ServerSection = field(default_factory=ServerSection)
    auth: AuthSection = field(default_factory=AuthSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    repair: RepairSection = field(default_factory=RepairSection)
    orphans: OrphansSection = field(default_factory=OrphansSection)
    tombstones: TombstonesSection = field(default_factory=TombstonesSection)
    eviction: EvictionSection = field(default_factory=EvictionSection)

    def __post_init__(self) -> None:
        if self.disk.enabled and not self.disk.path:
            raise ConfigError("disk.path: required when disk.enabled is true")
        # a memory tier needs one slab for payloads and one for the headers beside them
        if self.dram.capacity and self.dram.capacity < 2 * self.dram.slab_size:
            raise ConfigError(
                f"dram.capacity ({format_size(self.dram.capacity)}) must hold at least two slabs of "
                f"dram.slab_size ({format_size(self.dram.slab_size)}), or be 0 (tier off)"
            )
        if self.hbm.capacity and self.hbm.capacity < 2 * self.hbm.slab_size:
            raise ConfigError(
                "hbm.capacity must hold at least two slabs of hbm.slab_size, or be 0 (tier off)"
            )
        if self.dram.capacity == 0 and not self.disk.enabled:
            raise ConfigError("dram.capacity is 0 and disk.enabled is false: the node would store nothing")


def load_store_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> StoreConfig:
    """The store's config from ``path``, the process environment and ``overrides``."""
    return load_config(StoreConfig, path, os.environ if env is None else env, overrides)
