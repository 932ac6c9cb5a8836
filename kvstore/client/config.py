"""The client configs: :class:`ClientConfig` (how a client reaches nodes) and
:class:`ClusterConfig` (the cluster client's; docs/cluster.md lists every field and why)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.keys import Namespace


@dataclass(frozen=True)
class ClientConfig:
    """How a client reaches nodes. ``namespaces`` are the namespaces this client reads and
    writes (without tenant salt: the node applies the salt of the token's tenant).
    ``transport``: ``auto`` (RDMA when this host and the node have a verbs device, else TCP),
    ``tcp`` or ``rdma`` (docs/rdma.md); ``rdma_device``/``rdma_gid_index`` as the node's
    ``server.rdma_*`` keys. ``descriptors``: ``auto`` (the descriptor path where bytes can move
    one-sidedly) or ``always`` (also over TCP; see the module docstring). ``streams``: the
    connections one large inline GET or PUT batch is split over, at most ``pool_size``;
    ``pipeline``: the GET/PUT frames one connection has on the wire ahead of the reply being
    read (docs/configuration.md)."""

    token: str = ""
    tenant: str | None = None
    namespaces: tuple[Namespace, ...] = ()
    pool_size: int = 4
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 5.0
    probe_interval_s: float = 0.5
    transport: str = "auto"
    rdma_device: str = ""
    rdma_gid_index: int = 0
    descriptors: str = "auto"
    streams: int = 4
    pipeline: int = 4

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"transport: expected auto, tcp or rdma, got {self.transport!r}")
        if self.descriptors not in ("auto", "always"):
            raise ValueError(f"descriptors: expected auto or always, got {self.descriptors!r}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")
        if not 1 <= self.pipeline <= 64:
            raise ValueError(f"pipeline must be 1..64, got {self.pipeline}")
        for name in ("connect_timeout_s", "op_timeout_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    lookahead: int = 1  # nodes past the owners that lookups and reads also ask
    hedge: float = 0.5  # share of the time left one read round may take when a fallback exists
    probe_interval_s: float = 0.5
    probe_deadline_s: float = 0.25  # a suspect node's probe (all rounds) must finish this fast
    probe_rounds: int = 3  # EXISTS calls per probe, each of probe_keys keys (~70 KiB for 4096)
    probe_keys: int = 4096
    probe_factor: float = 2.0  # a suspect's probe may take this many times a healthy peer's at most
    eject_base_s: float = 1.0  # an ejected node stays out this long, doubled per re-ejection
    eject_max_s: float = 30.0
    flap_window_s: float = 60.0  # ejections this close together count as one flapping node
    outlier_factor: float = 5.0  # latency over this many times the others' median: ejected
    hedge_factor: float = 4.0  # a read waits this many times the node's expected time ...
    hedge_floor_s: float = 0.05  # ... but at least this long, before going to the next replica
    read_repair: bool = True  # copy a block read from a non-owner to the owners that missed it
    repair_max_blocks: int = 256  # repairs in flight at most; more are skipped (counted)
    connect_timeout_s: float = 3.0  # a connection's set-up at most (each call's deadline bounds it too)
    write_floor_s: float = 0.5  # a node's write deadline: this + bytes in flight / write_min_bytes_per_s
    write_min_bytes_per_s: float = float(64 << 20)  # slower than this, a node's write is redirected
    write_chunk_bytes: int = 8 << 20  # a node's share of a batch goes in chunks of about this size
    health_window_s: float = 5.0  # nodes are compared over their samples of this last window
    late_eject_count: int = 3  # hedged-away reads in one window before lateness may eject
    bandwidth_min_bytes: int = 64 << 10  # smaller reads say too little about bandwidth
    confirm_timeout_s: float = 0.5  # a lookup past its deadline: the node must answer this fast
    loop_lag_interval_s: float = 0.01  # how often the client's own loop lag is sampled

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if not 0 < self.hedge <= 1:
            raise ValueError(f"hedge must be in (0, 1], got {self.hedge}")
        if not 1 <= self.probe_keys <= 4096 or self.probe_rounds < 1:
            raise ValueError(
                f"probe_keys must be in [1, 4096] and probe_rounds >= 1, got {self.probe_keys}, {self.probe_rounds}"
            )
        if self.late_eject_count < 1 or self.bandwidth_min_bytes < 1:
            raise ValueError(
                f"late_eject_count and bandwidth_min_bytes must be >= 1, got {self.late_eject_count}, "
                f"{self.bandwidth_min_bytes}"
            )
        if self.write_chunk_bytes < 1:
            raise ValueError(f"write_chunk_bytes must be >= 1, got {self.write_chunk_bytes}")
        for name in (
            "probe_interval_s",
            "probe_deadline_s",
            "connect_timeout_s",
            "write_floor_s",
            "write_min_bytes_per_s",
            "eject_base_s",
            "eject_max_s",
            "flap_window_s",
            "outlier_factor",
            "probe_factor",
            "hedge_factor",
            "hedge_floor_s",
            "health_window_s",
            "confirm_timeout_s",
            "loop_lag_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
