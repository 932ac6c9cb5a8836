"""HELLO: the namespace on the wire, the request, the node's reply (with its RDMA offer), error replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvstore.errors import KeyFormatError
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.protocol.fields import (
    BAD_VERSION,
    MAX_BATCH,
    MAX_EXISTS_KEYS,
    PROTOCOL_VERSION,
    ProtocolError,
    _items,
    _str,
    _u64,
    bad,
    request_rid,
)
from rdma.framing import payload_len
from rdma.transport import QPInfo, Region, TransportError


def namespace_to_wire(ns: Namespace) -> dict[str, Any]:
    return {
        "model": ns.model_fingerprint,
        "dtype": ns.kv_dtype,
        "block_tokens": ns.block_tokens,
        "layout": ns.layout,
        "tp": [ns.tp_size, ns.tp_rank],
        "hash": ns.hash,
        "v": ns.version,
    }


def namespace_from_wire(d: Any, salt: str, where: str) -> Namespace:
    if not isinstance(d, dict):
        raise bad(f"{where} must be a map")
    try:
        tp = d.get("tp", [1, 0])
        if not isinstance(tp, list) or len(tp) != 2:
            raise bad(f"{where}.tp must be [size, rank]")
        return Namespace(
            model_fingerprint=_str(d["model"], f"{where}.model"),
            kv_dtype=_str(d["dtype"], f"{where}.dtype"),
            block_tokens=d["block_tokens"],
            layout=_str(d.get("layout", "LKTHD"), f"{where}.layout"),
            tp_size=tp[0],
            tp_rank=tp[1],
            tenant_salt=salt,
            hash=_str(d.get("hash", "xxh3_128"), f"{where}.hash"),
            version=d.get("v", 1),
        )
    except KeyError as exc:
        raise bad(f"{where} lacks {exc.args[0]!r}") from exc
    except KeyFormatError as exc:
        raise bad(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class Hello:
    """HELLO. ``namespaces`` are wire maps without a tenant salt, checked only by
    :meth:`namespaces_with` once the token is known: the daemon adds the salt of the tenant
    the token authenticates, never the one the client claims."""

    OP: ClassVar[str] = "HELLO"
    rid: int
    token: str
    tenant: str | None
    namespaces: tuple[Any, ...]
    rdma: QPInfo | None = None  # the client's queue pair, when it offers RDMA
    version: int = PROTOCOL_VERSION

    @classmethod
    def of(cls, token: str, tenant: str | None, nss, rdma: QPInfo | None = None) -> Hello:
        """The client's HELLO for ``nss`` (Namespaces; their salt is not sent)."""
        return cls(0, token, tenant, tuple(namespace_to_wire(ns) for ns in nss), rdma)

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": self.OP,
            "rid": self.rid,
            "v": self.version,
            "token": self.token,
            "tenant": self.tenant,
            "ns": list(self.namespaces),
            "rdma": self.rdma.to_wire() if self.rdma is not None else None,
        }

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> Hello:
        """``bad_version`` for another protocol version (checked first), ``bad_request`` for a
        malformed field (``rdma``: QP info that :meth:`QPInfo.from_wire` refuses)."""
        v = h.get("v")
        if v != PROTOCOL_VERSION or isinstance(v, bool):
            raise ProtocolError(
                BAD_VERSION,
                f"client protocol version {v!r} is not supported (this node speaks {PROTOCOL_VERSION})",
            )
        rid = _u64(h.get("rid"), "rid")
        token = h.get("token", "")
        if not isinstance(token, str):
            raise bad("token must be a string")
        tenant = h.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise bad("tenant must be a string or nil")
        ns = h.get("ns", [])
        if not isinstance(ns, list) or len(ns) > 64:
            raise bad("ns must be a list of at most 64 namespaces")
        offer = h.get("rdma")
        try:
            qp = QPInfo.from_wire(offer) if offer is not None else None
        except TransportError as exc:
            raise bad(f"rdma: {exc}") from exc
        return cls(rid, token, tenant, tuple(ns), qp, v)

    def namespaces_with(self, salt: str) -> list[Namespace]:
        """The declared namespaces under ``salt``; ProtocolError naming ``ns[i]``."""
        return [namespace_from_wire(d, salt, f"ns[{i}]") for i, d in enumerate(self.namespaces)]


@dataclass(frozen=True)
class RdmaReply:
    """HELLO reply's ``rdma``: the node's queue pair (connected to the client's) and its
    registered DRAM slab, which LEASE/RESERVE descriptors with ``rdma: true`` point into."""

    qp: QPInfo
    slab: Region

    def to_wire(self) -> dict[str, Any]:
        return {"qp": self.qp.to_wire(), "slab": self.slab.to_wire()}

    @classmethod
    def from_wire(cls, obj: Any) -> RdmaReply | None:
        """None for nil (the node moves bytes inline only); ProtocolError naming the bad field."""
        if obj is None:
            return None
        if not isinstance(obj, dict):
            raise bad(f"HELLO reply rdma must be a map or nil, got {type(obj).__name__}")
        try:
            return cls(QPInfo.from_wire(obj.get("qp")), Region.from_wire(obj.get("slab")))
        except TransportError as exc:
            raise bad(f"HELLO reply rdma: {exc}") from exc


@dataclass(frozen=True)
class HelloReply:
    """The node's welcome: the tenant the token names, its salt, the declared namespaces'
    ids (request order), the node's name and ``max_frame``, ``rdma`` (None: inline), and
    ``exists_keys``: the most keys one EXISTS to it may carry (a node that does not say
    takes ``MAX_BATCH``; a client never sends more than its own ``MAX_EXISTS_KEYS``)."""

    rid: int
    tenant: str
    salt: str
    ns: tuple[bytes, ...]
    node: str
    max_frame: int
    rdma: RdmaReply | None = None
    version: int = PROTOCOL_VERSION
    exists_keys: int = MAX_EXISTS_KEYS

    def to_wire(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "ok": True,
            "v": self.version,
            "tenant": self.tenant,
            "salt": self.salt,
            "ns": list(self.ns),
            "node": self.node,
            "max_frame": self.max_frame,
            "rdma": self.rdma.to_wire() if self.rdma is not None else None,
            "exists_keys": self.exists_keys,
        }

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> HelloReply:
        """``bad_version`` (checked first) when the node speaks another protocol version."""
        v = h.get("v")
        if v != PROTOCOL_VERSION or isinstance(v, bool):
            raise ProtocolError(
                BAD_VERSION,
                f"node protocol version {v!r} is not supported (this client speaks {PROTOCOL_VERSION})",
            )
        ns = _items(h, "ns", None, 0)
        if not all(isinstance(x, bytes) and len(x) == KEY_BYTES for x in ns):
            raise bad(f"ns must hold {KEY_BYTES}-byte namespace ids")
        max_frame = h.get("max_frame", 64 << 20)
        if _u64(max_frame, "max_frame") == 0:
            raise bad("max_frame must be positive")
        exists_keys = h.get("exists_keys", MAX_BATCH)  # a node from before the field: 4096
        # every node of this protocol takes MAX_BATCH keys; a lower claim would only multiply
        # the round trips of one lookup (a node saying 1: thousands of them on the engine's loop)
        if _u64(exists_keys, "exists_keys") < MAX_BATCH:
            raise bad(f"exists_keys must be at least {MAX_BATCH}, got {exists_keys}")
        return cls(
            _u64(h.get("rid"), "rid"),
            _str(h.get("tenant"), "tenant"),
            _str(h.get("salt"), "salt"),
            tuple(ns),
            _str(h.get("node", ""), "node"),
            max_frame,
            RdmaReply.from_wire(h.get("rdma")),
            v,
            exists_keys,
        )


@dataclass(frozen=True)
class ErrorReply:
    """A failed reply: ``code`` (one of the codes above) and ``err`` (text). ``plen``: payload
    bytes that follow it anyway (the reader skips them)."""

    rid: int
    code: str
    err: str
    plen: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": False, "code": self.code, "err": self.err}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> ErrorReply:
        """Lenient about the text fields (an error must always be reportable)."""
        return cls(request_rid(h), str(h.get("code")), str(h.get("err")), payload_len(h))


def check_reply(h: dict[str, Any], rid: int) -> ErrorReply | None:
    """A reply map's outcome for request ``rid``: an ErrorReply when it failed, None when it
    succeeded; ProtocolError when ``ok`` is not a bool or it answers another request."""
    ok = h.get("ok")
    if not isinstance(ok, bool):
        raise bad(f"reply ok must be true or false, got {ok!r:.40}")
    if not ok:
        return ErrorReply.from_wire(h)
    if h.get("rid") != rid:
        raise bad(f"reply for request {h.get('rid')!r}, expected {rid}")
    return None
