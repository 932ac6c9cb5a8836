"""The connector's configuration: from the ``--kv-connector`` URL, its query, and an optional
TOML file (``?config=PATH`` or the engine's ``--kv-connector-config``). Later sources win:
TOML, then the URL query. Errors name the key and the URL.

URLs:
  kvstore://host:port[,host:port...]   storage daemons (kvstore serve)
  local://PATH                          an in-process node: DRAM + LMDB disk under PATH
  etcd://host:port/CLUSTER              daemons found through etcd (cluster membership)
"""

from __future__ import annotations

import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

from kvstore.client import AddressError, ConfigError, Size, coerce, parse_host_port


@dataclass(frozen=True)
class ConnectorConfig:
    kind: Literal["kvstore", "local", "etcd"]
    target: str  # "host:port,..." | PATH | "host:port/CLUSTER"
    block_tokens: int = 0  # 0: the engine's page size
    lookup_deadline_s: float = 0.2  # under one prefill chunk; the engine waits for it (+1 s backstop)
    load_deadline_s: float = 2.0
    save_deadline_s: float = 5.0
    policy: Literal["auto", "always", "never"] = "auto"
    save: bool = True
    save_queue_bytes: Size = Size(512 << 20)  # host memory for blocks waiting to be written
    # blocks per read (one request per node, streamed); 0: sized from the read bandwidth, at
    # most 128 MiB (connector/loader.py); batches are pipelined, their copies overlap the reads
    load_batch_blocks: int = 0
    # load_batch_blocks = 0: a batch is what a read finishes in half of load_deadline_s at the
    # read bandwidth last measured, never below this floor (bytes/s; only it until measured
    # and after a read that ran out its deadline): a slow-but-moving link loads a prefix
    load_floor_bandwidth: Size = Size(16 << 20)
    # reads of one load in flight at once (each is split over the store client's connections)
    load_parallel: int = 1
    # host memory all loads' staging slots may hold at once (concurrent loads past it wait for
    # a slot, within load_deadline_s); never fewer than the load_parallel + 1 slots made at start
    load_staging_bytes: Size = Size(1 << 30)
    # loads copy blocks in this many groups of layers, so group g+1 arrives while g computes
    # (CUDA): 0 = the engine's choice (4 for large blocks on CUDA, see docs/connector.md), 1 = whole
    layer_groups: int = 0
    tenant: str = ""  # the tenant the token belongs to: keys are computed in its salted namespace
    token: str = ""
    token_file: str = ""
    # assumed until measured: a tier's bandwidth (bytes/s) and the engine's prefill (tokens/s)
    prefill_tokens_per_s: float = 2000.0
    replicas: int = 2  # kvstore:// and etcd://: copies of each block, on distinct nodes
    # local:// only
    dram_capacity: Size = Size(1 << 30)
    disk_capacity: Size = Size(8 << 30)
    disk_sync: bool = False  # a cache: losing the last writes on power loss costs only a recompute

    @property
    def addrs(self) -> list[str]:
        return [a for a in self.target.split(",") if a] if self.kind == "kvstore" else []


def _fields() -> dict[str, object]:
    return {k: t for k, t in typing.get_type_hints(ConnectorConfig).items() if k not in ("kind", "target")}


def parse_connector_url(
    url: str,
    config_path: str | None = None,
    options: Mapping[str, object] | None = None,
    options_source: str = "options",
) -> ConnectorConfig:
    """Parse ``url`` (and the TOML at ``config_path`` or ``?config=``, and ``options``: typed
    values such as vLLM's ``kv_connector_extra_config``, named ``options_source`` in errors)
    into a config. Later sources win: TOML, ``options``, the URL query. TOML and ``options``
    values must have their key's type; query values are text, parsed by the same coercion as
    the store's environment (kvstore.config.coerce: sizes by parse_size). Raises ConfigError
    naming the URL, the bad key and where its value came from."""
    parts = urlsplit(url)
    kind = parts.scheme
    if kind not in ("kvstore", "local", "etcd"):
        raise ConfigError(f"--kv-connector {url!r}: scheme must be kvstore, local or etcd")
    if kind == "local":
        target = unquote(parts.netloc + parts.path)
    elif kind == "etcd":
        target = parts.netloc + parts.path
    else:
        target = parts.netloc
    if not target:
        raise ConfigError(f"--kv-connector {url!r}: missing {'PATH' if kind == 'local' else 'host:port'}")
    values: dict[str, tuple[object, str, bool]] = {}  # key -> (value, source, text)
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    path = query.pop("config", None) or config_path
    if path:
        try:
            with open(path, "rb") as f:
                values.update((k, (v, f"file {path}", False)) for k, v in tomllib.load(f).items())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--kv-connector config {path!r}: {exc}") from exc
    values.update((k, (v, options_source, False)) for k, v in (options or {}).items())
    values.update((k, (v, "URL query", True)) for k, v in query.items())
    fields = _fields()
    kwargs: dict[str, object] = {}
    for key, (value, source, text) in values.items():
        if key not in fields:
            raise ConfigError(f"--kv-connector {url!r}: unknown option {key!r} ({source})")
        try:
            kwargs[key] = coerce(key, fields[key], value, text=text)
        except ConfigError as exc:
            raise ConfigError(f"--kv-connector {url!r}: option {exc} ({source})") from None
    cfg = ConnectorConfig(kind=kind, target=target, **kwargs)
    for key in ("lookup_deadline_s", "load_deadline_s", "save_deadline_s", "prefill_tokens_per_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"--kv-connector {url!r}: {key} must be > 0")
    if (
        cfg.block_tokens < 0
        or cfg.save_queue_bytes < 1
        or cfg.load_batch_blocks < 0
        or cfg.load_floor_bandwidth < 1
        or cfg.load_parallel < 1
        or cfg.load_staging_bytes < 1
        or cfg.replicas < 1
        or cfg.layer_groups < 0
    ):
        raise ConfigError(f"--kv-connector {url!r}: block_tokens, queue and batch sizes must be positive")
    if kind == "kvstore":
        for a in cfg.addrs:
            try:
                parse_host_port(a, "node address")
            except AddressError as exc:
                raise ConfigError(f"--kv-connector {url!r}: {exc}") from exc
    return cfg
