"""``kvstore.client.open(url, **options)``: the one way in to a store.

URLs (options may also come as the URL's query, ``?replicas=3&transport=tcp``; keyword
options win over the query):

  local://PATH                        an in-process node: DRAM + LMDB disk under PATH
                                      (:class:`kvstore.client.local.LocalClient`)
  kvstore://host:port[,host:port...]  storage daemons, a static list
  etcd://host:port[,...]/CLUSTER      daemons registered in etcd (watched)

The last two are the replicated :class:`kvstore.client.cluster.ClusterClient`.

Options. Every scheme: ``op_timeout_s`` (a call's default deadline). ``local://``:
``dram_capacity``, ``disk_capacity`` (bytes or sizes like ``"1GiB"``), ``disk_sync``.
Daemons: the fields of :class:`kvstore.client.config.ClientConfig` (``token``, ``tenant``,
``namespaces``, ``pool_size``, ``connect_timeout_s``, ``probe_interval_s``, ``transport``,
``rdma_device``, ``rdma_gid_index``, ``descriptors``), ``token_file`` (a file whose first word
is the token, read when no ``token`` is given) and the fields of
:class:`kvstore.client.config.ClusterConfig` (``replicas``, ``lookahead``, ...).

:func:`members` lists the nodes registered under an ``etcd://`` URL (what the CLI's
``--cluster`` asks).

Errors: ConfigError naming the URL and the option for a bad scheme, target or option;
TransportError when ``transport`` is ``rdma`` and this host has no RDMA device. Nothing is
connected or opened here: ``start()`` or the first call does that. Everything heavy is
imported only when a URL asks for it.
"""

from __future__ import annotations

import builtins
import typing
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.client.api import StoreClient
    from kvstore.client.membership import Member

SCHEMES = ("local", "kvstore", "etcd")


def open(url: str, **options: Any) -> StoreClient:  # noqa: A001 - the facade's one verb
    """A :class:`~kvstore.client.api.StoreClient` for ``url``; see the module docstring."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in SCHEMES:
        raise ConfigError(f"store URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    opts: dict[str, Any] = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    opts.update(options)
    if scheme == "local":
        return _local(url, unquote(parts.netloc + parts.path), opts)
    target = parts.netloc + (parts.path if scheme == "etcd" else "")
    if not target:
        raise ConfigError(f"store URL {url!r}: missing host:port")
    return _cluster(url, scheme, target, opts)


async def members(url: str, timeout_s: float = 2.0) -> list[Member]:
    """The nodes registered under the ``etcd://host:port[,...]/CLUSTER`` URL now: one read,
    no watch; records that do not parse are skipped. ConfigError naming the URL when it is
    bad; ConnectionError naming etcd when it does not answer within ``timeout_s``."""
    from kvstore.client.etcd import EtcdClient, EtcdError, parse_etcd_url
    from kvstore.client.membership import Member, MembershipError

    try:
        target = parse_etcd_url(url)
    except MembershipError as exc:
        raise ConfigError(str(exc)) from exc
    client = EtcdClient(target.endpoints, timeout_s=timeout_s)
    try:
        kvs, _ = await client.range_prefix(target.prefix)
    except EtcdError as exc:
        raise ConnectionError(str(exc)) from exc
    finally:
        await client.close()
    out = []
    for _, raw in kvs:
        try:
            out.append(Member.from_json(raw))
        except MembershipError:
            continue  # another writer's record, or one from a newer format
    return out


def _local(url: str, path: str, opts: dict[str, Any]) -> StoreClient:
    from kvstore.client.local import LocalClient
    from kvstore.config import Size

    types = {"dram_capacity": Size, "disk_capacity": Size, "disk_sync": bool, "op_timeout_s": float}
    if not path:
        raise ConfigError(f"store URL {url!r}: missing PATH")
    kwargs = {}
    for key, value in opts.items():
        if key not in types:
            raise ConfigError(f"store URL {url!r}: unknown option {key!r} for local://")
        kwargs[key] = _coerce(url, key, types[key], value)
    try:
        return LocalClient(path, **kwargs)
    except ConfigError as exc:  # the node's config names the key (dram.capacity, ...)
        raise ConfigError(f"store URL {url!r}: {exc}") from exc


def _cluster(url: str, scheme: str, target: str, opts: dict[str, Any]) -> StoreClient:
    from kvstore.address import parse_host_port
    from kvstore.client.cluster import ClusterClient
    from kvstore.client.config import ClientConfig, ClusterConfig
    from kvstore.client.membership import MembershipError
    from kvstore.errors import AddressError

    client_fields = typing.get_type_hints(ClientConfig)
    cluster_fields = typing.get_type_hints(ClusterConfig)
    token_file = opts.pop("token_file", "")
    client_kw: dict[str, Any] = {}
    cluster_kw: dict[str, Any] = {}
    for key, value in opts.items():
        if key == "namespaces":  # Namespace objects: from Python only, never from the query
            client_kw[key] = tuple(value)
        elif key in client_fields:
            client_kw[key] = _coerce(url, key, client_fields[key], value)
        elif key in cluster_fields:
            cluster_kw[key] = _coerce(url, key, cluster_fields[key], value)
        else:
            raise ConfigError(f"store URL {url!r}: unknown option {key!r}")
    if token_file and not client_kw.get("token"):
        client_kw["token"] = _read_token(url, token_file)
    if client_kw.get("tenant") == "":
        client_kw["tenant"] = None  # no tenant: the token's own
    try:
        ccfg = ClientConfig(**client_kw)
        cluster = ClusterConfig(**cluster_kw)
    except ValueError as exc:  # the configs name the field
        raise ConfigError(f"store URL {url!r}: {exc}") from exc
    if scheme == "etcd":
        try:
            return ClusterClient.etcd(f"etcd://{target}", ccfg, cluster)
        except MembershipError as exc:
            raise ConfigError(f"store URL {url!r}: {exc}") from exc
    addrs = [a for a in target.split(",") if a]
    for a in addrs:
        try:
            parse_host_port(a, "node address")
        except AddressError as exc:
            raise ConfigError(f"store URL {url!r}: {exc}") from exc
    return ClusterClient.static(addrs, ccfg, cluster)


def _read_token(url: str, path: str) -> str:
    """The first word of ``token_file`` (as the daemons' token files are written)."""
    try:
        with builtins.open(path) as f:
            words = f.read().split()
    except OSError as exc:
        raise ConfigError(f"store URL {url!r}: token_file {path!r}: {exc.strerror}") from exc
    if not words:
        raise ConfigError(f"store URL {url!r}: token_file {path!r} is empty")
    return words[0]


def _coerce(url: str, key: str, tp: Any, value: Any) -> Any:
    """``value`` (a Python value, or text from the URL's query) as a field of type ``tp``: the
    one coercion of every config source (:func:`kvstore.config.coerce`)."""
    from kvstore.config import coerce

    if value is None and type(None) in typing.get_args(tp):  # an optional field left unset
        return None
    try:
        return coerce(key, tp, value, text=isinstance(value, str))
    except ConfigError as exc:  # names the option and the value
        raise ConfigError(f"store URL {url!r}: {exc}") from exc
