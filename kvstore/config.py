"""Configuration: one TOML file per role, then ``TIERKV_*`` environment variables, then
explicit overrides and command-line flags, parsed into frozen dataclasses.

An unknown key or a bad value is a :class:`ConfigError` naming the key (``dram.capacity``) and
where the value came from (the file, the variable, the flag), never a warning. Sizes go
through :func:`parse_size`, the project's one size parser (docs/configuration.md has its unit
table). Environment variables name a key as ``TIERKV_<SECTION>__<KEY>``
(``TIERKV_DRAM__CAPACITY=2GiB``, ``TIERKV_ENGINE__KV_CACHE_BYTES=8GiB``). Every default is safe
on a laptop.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from kvstore.errors import ConfigError

ENV_PREFIX = "TIERKV_"

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
# the whole unit table, matched case-insensitively: IEC units are binary, SI units decimal;
# a bare K/M/G is refused because half the world reads it one way and half the other
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_HELP = "a byte count, or a number with B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)"


def parse_size(value: Any, name: str = "size") -> int:
    """A size in bytes: an int >= 0, or text: a number (bytes) or a number and a unit of
    ``SIZE_UNITS`` (case-insensitive): ``B``; ``KiB MiB GiB TiB`` = 2^10..2^40;
    ``KB MB GB TB`` = 10^3..10^12. ``"1.5GiB"`` is fine; a result that is not a whole number
    of bytes is not. Raises ConfigError naming ``name`` and the value for anything else (a bare
    ``K``, ``12XB``, a negative number, a bool or float)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name}: a size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in SIZE_UNITS:
            n = Decimal(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
            if n != n.to_integral_value():
                raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
            return int(n)
    raise ConfigError(f"{name}: {value!r} is not a size ({_SIZE_HELP})")


def format_size(n: float) -> str:
    """Bytes as a short human string: ``format_size(3*2**30) == '3.0GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}PiB"  # pragma: no cover


class Size(int):
    """Marker type for size fields: parsed with :func:`parse_size`."""


# ---------------------------------------------------------------- the store's sections


@dataclass(frozen=True)
class NodeSection:
    name: str = ""  # defaults to the host name at start
    promote_on_read: bool = True
    lease_ttl_s: float = 30.0
    zone: str = ""


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
    max_unauthenticated: int = 64  # open connections that have not passed HELLO
    max_conns_per_tenant: int = 256  # open authenticated connections per tenant
    max_header_unauthenticated: Size = Size(64 * 1024)  # frame header before HELLO
    max_leases_per_conn: int = 4096  # LEASE + RESERVE handles one connection may hold
    max_lease_ttl_s: float = 300.0  # the longest LEASE ttl a client may ask for

    def __post_init__(self) -> None:
        for name in ("hello_timeout_s", "idle_timeout_s", "transfer_timeout_s", "max_lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"limits.{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_unauthenticated", "max_conns_per_tenant", "max_leases_per_conn"):
            if getattr(self, name) < 1:
                raise ConfigError(f"limits.{name}: must be >= 1, got {getattr(self, name)}")
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
        if self.replicas < 1:
            raise ConfigError(f"repair.replicas: must be >= 1, got {self.replicas}")
        if self.batch_keys < 1:
            raise ConfigError(f"repair.batch_keys: must be >= 1, got {self.batch_keys}")
        for name in ("interval_s", "deadline_s", "max_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"repair.{name}: must be > 0, got {getattr(self, name)}")
        if self.settle_s < 0:
            raise ConfigError(f"repair.settle_s: must be >= 0, got {self.settle_s}")


@dataclass(frozen=True)
class EvictionSection:
    """Which blocks leave a tier first, and what one namespace may take from another
    (docs/storage.md "Eviction", docs/security.md "Per-tenant shares")."""

    policy: Literal["lru", "prefix-lru", "prefix-2q", "prefix-arc"] = "prefix-arc"
    probation: float = 0.1  # prefix-2q: the share of a tier's blocks new, unread ones may hold
    ghosts: float = 4.0  # prefix-2q: keys evicted from probation remembered, x blocks held
    # a namespace holding at most this share of a tier's bytes keeps them against another
    # namespace's writes (that namespace's own blocks go first); 0: no shares
    tenant_share: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.probation < 1.0:
            raise ConfigError(f"eviction.probation: must be in [0, 1), got {self.probation}")
        if not 0.0 <= self.ghosts <= 64.0:
            raise ConfigError(f"eviction.ghosts: must be in [0, 64], got {self.ghosts}")
        if not 0.0 <= self.tenant_share <= 1.0:
            raise ConfigError(f"eviction.tenant_share: must be in [0, 1], got {self.tenant_share}")


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


# ---------------------------------------------------------------- the generic loader


@dataclass(frozen=True)
class _Value:
    """One setting from one source: ``text`` values (environment, flags, URL queries) are
    parsed into the field's type; others (TOML, Python) must already have it."""

    value: Any
    source: str  # "file node.toml", "env TIERKV_DRAM__CAPACITY", "flag --kv-cache-bytes"
    text: bool


def load_config(
    cls: type,
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, tuple[str, str]] | None = None,
):
    """Build ``cls`` (a frozen dataclass of section dataclasses) from, in rising priority: its
    defaults, the TOML file at ``path``, ``TIERKV_SECTION__KEY`` variables in ``env`` (pass
    ``os.environ`` explicitly; None means none; variables of sections ``cls`` lacks belong to
    other roles and are skipped), ``overrides`` (``{"dram.capacity": "1GiB"}``, typed as TOML
    values are) and ``flags`` (``{"engine.page_size": ("--page-size", "16")}``: command-line
    text, parsed as environment values are). Raises ConfigError naming the key and its source
    on any unknown key or bad value, and naming the file when it is missing or not TOML."""
    sections = {f.name: f for f in dataclasses.fields(cls)}
    merged: dict[str, dict[str, _Value]] = {s: {} for s in sections}

    def put(sec: str, key: str, v: _Value) -> None:
        if sec not in sections:
            raise ConfigError(f"{sec}: unknown section ({v.source}; known: {', '.join(sections)})")
        if not key:
            raise ConfigError(f"{sec}: a key is missing ({v.source})")
        merged[sec][key] = v

    if path is not None:
        src = f"file {os.fspath(path)}"
        for sec, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{sec}: expected a table ({src})")
            for key, value in table.items():
                put(sec, key, _Value(value, src, False))
    for name, value in (env or {}).items():
        sec, sep, key = name.removeprefix(ENV_PREFIX).lower().partition("__")
        if name.startswith(ENV_PREFIX) and sep and sec in sections:
            put(sec, key, _Value(value, f"env {name}", True))
    for dotted, value in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        put(sec, key, _Value(value, f"override {dotted}", False))
    for dotted, (flag, text) in (flags or {}).items():
        sec, _, key = dotted.partition(".")
        put(sec, key, _Value(text, f"flag {flag}", True))
    built = {sec: _build_section(sec, _resolve(f.type, cls), merged[sec]) for sec, f in sections.items()}
    try:
        return cls(**built)
    except TypeError as exc:  # pragma: no cover - programming error
        raise ConfigError(str(exc)) from exc


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") from exc


def _resolve(tp, owner):
    if isinstance(tp, str):
        hints = typing.get_type_hints(owner)
        return hints[tp] if tp in hints else eval(tp, vars(sys.modules[owner.__module__]))  # noqa: S307
    return tp


def _build_section(sec: str, sec_cls: type, values: dict[str, _Value]):
    hints = typing.get_type_hints(sec_cls)
    known = {f.name for f in dataclasses.fields(sec_cls)}
    kwargs = {}
    for key, v in values.items():
        if key not in known:
            raise ConfigError(f"{sec}.{key}: unknown key ({v.source}; known: {', '.join(sorted(known))})")
        try:
            kwargs[key] = coerce(f"{sec}.{key}", hints[key], v.value, text=v.text)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({v.source})") from None
    try:
        return sec_cls(**kwargs)
    except ConfigError as exc:
        # a check across values (__post_init__) names its key: say where that value came from
        msg = str(exc)
        key = next((k for k in values if msg.startswith(f"{sec}.{k}:")), None)
        if key is None:
            raise
        raise ConfigError(f"{msg} ({values[key].source})") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{sec}: {exc}") from exc


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def coerce(name: str, tp: Any, value: Any, *, text: bool = False) -> Any:
    """``value`` as a field of type ``tp``: int, float, bool, str, :class:`Size`,
    ``Literal[...]``, ``tuple[X, ...]`` or ``X | None``. ``text``: the value arrived as text (an
    environment variable, a flag, a URL query) and is parsed (``"8"`` -> 8, ``"on"`` -> True,
    ``"a,b"`` -> a tuple); otherwise (TOML, Python) it must already have the type, save that
    an int is a float too. The one coercion of every config source: the store's and engine's
    loader and the connector's URL. Raises ConfigError naming ``name`` and the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # pragma: no cover - programming error
            raise ConfigError(f"{name}: only X | None unions are supported in config")
        return coerce(name, args[0], value, text=text)
    if tp is Size:
        return Size(parse_size(value, name))
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and "true" in choices:
            value = "true" if value else "false"
        if value not in choices:
            raise ConfigError(f"{name}: expected one of {list(choices)}, got {value!r}")
        return str(value)
    if tp is bool:
        if isinstance(value, bool) and not text:
            return value
        if text and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp in (int, float):
        if text:
            try:
                return tp(value)
            except ValueError:
                pass
        elif isinstance(value, (int, tp)) and not isinstance(value, bool):
            return tp(value)
        kind = "an integer" if tp is int else "a number"
        raise ConfigError(f"{name}: expected {kind}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if origin is tuple:  # tuple[X, ...]
        item = typing.get_args(tp)[0]
        if text:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(coerce(f"{name}[{i}]", item, v, text=text) for i, v in enumerate(value))
    raise ConfigError(f"{name}: unsupported field type {tp!r}")  # pragma: no cover


def load_store_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> StoreConfig:
    """The store's config from ``path``, the process environment and ``overrides``."""
    return load_config(StoreConfig, path, os.environ if env is None else env, overrides)
