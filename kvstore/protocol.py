"""The data-port protocol: operations, versioning, limits, and one typed message per frame.

A frame is ``[u32 header length][msgpack map][raw payload]`` (framing, ``plen`` and the
zero-copy socket I/O live in :mod:`rdma.tcp`); this module says what the maps contain, and is
the only place that names their fields. Each op has a request and a reply dataclass (frozen):
``to_wire()`` gives the map to send, ``from_wire(map)`` validates every field and raises
:class:`ProtocolError` naming the bad one (``bad_request``; ``unknown_op``/``bad_version``
where the code says so). Every request carries ``rid`` (echoed in its reply); a failed reply
is an :class:`ErrorReply`. Per-key results are named records (:class:`GetEntry`,
:class:`LeaseEntry`, :class:`ReserveEntry`, :class:`~kvstore.results.PutResult`), sent as
short positional lists. docs/protocol.md specifies every frame. Nothing here touches a
socket; everything is immutable and thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError, KeyFormatError, TierKVError
from kvstore.keys import KEY_BYTES, BlockKey, Namespace
from kvstore.results import Expect, PutResult, Status
from rdma.tcp import payload_len
from rdma.transport import QPInfo, Region, RemoteDescriptor, TransportError

PROTOCOL_VERSION = 1
MAX_HEADER = 4 << 20  # request header maps; 256 block headers of 1024 tokens each fit
MAX_BATCH = 4096  # keys (or descriptors, handles) per request
MAX_BLOCKS = 256  # block headers per GET/PUT frame that clients send; keeps headers under MAX_HEADER
MAX_REPLY_HEADER = 16 << 20  # what a client accepts from a node

# error codes (the ``code`` of a failed reply)
BAD_FRAME = "bad_frame"  # unparseable frame: connection closed after the reply
TOO_LARGE = "too_large"  # length over the maximum: connection closed after the reply
BAD_VERSION = "bad_version"  # HELLO with an unsupported version: connection closed
AUTH = "auth"  # wrong token / tenant claim, or an op before HELLO: connection closed
UNKNOWN_OP = "unknown_op"  # the connection stays usable
BAD_REQUEST = "bad_request"  # a field is missing or mistyped; the connection stays usable
INTERNAL = "internal"  # the node failed; the connection stays usable
CLOSING = "closing"  # the daemon is shutting down
TRANSPORT = "transport"  # HELLO: the node requires RDMA and the client offered none; closed
BUSY = "busy"  # HELLO: the tenant has as many connections open as the node allows; closed
FATAL_CODES = frozenset({BAD_FRAME, TOO_LARGE, BAD_VERSION, AUTH, TRANSPORT})


class ProtocolError(TierKVError):
    """A request or reply does not follow the protocol; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def bad(message: str) -> ProtocolError:
    return ProtocolError(BAD_REQUEST, message)


# ---------------------------------------------------------------- field parsers


def _u64(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**64:
        raise bad(f"{name} must be a u64, got {v!r}")
    return v


def _str(v: Any, name: str, nil: bool = False) -> str | None:
    if v is None and nil:
        return None
    if not isinstance(v, str):
        raise bad(f"{name} must be a string{' or nil' if nil else ''}, got {type(v).__name__}")
    return v


def _list(h: dict[str, Any], field: str, n: int | None = None) -> list:
    v = h.get(field)
    if not isinstance(v, list):
        raise bad(f"{field} must be a list, got {type(v).__name__}")
    if len(v) > MAX_BATCH:
        raise bad(f"{field} has {len(v)} items; at most {MAX_BATCH} per request")
    if n is not None and len(v) != n:
        raise bad(f"{field} has {len(v)} items, expected {n}")
    return v


def _items(h: dict[str, Any], field: str, n: int | None, size: int) -> list:
    """A reply's per-key list: ``n`` items (when given), each a list of ``size`` (when > 0)."""
    v = h.get(field)
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise bad(f"{field} must be a list of {n} results, got {v!r:.80}")
    for i, item in enumerate(v):
        if size and (not isinstance(item, list) or len(item) != size):
            raise bad(f"{field}[{i}] must be a list of {size} fields, got {item!r:.80}")
    return v


def req_op(h: dict[str, Any]) -> tuple[str, int]:
    """``(op, rid)`` of a request map; ProtocolError for a missing rid or an unknown op."""
    rid = _u64(h.get("rid"), "rid")
    op = h.get("op")
    if not isinstance(op, str) or op not in REQUESTS:  # a list or map is unhashable: type first
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}")
    return op, rid


def request_rid(h: dict[str, Any]) -> int:
    """The rid an error reply to ``h`` echoes: the request's when it is an int, else 0."""
    rid = h.get("rid")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def req_keys(h: dict[str, Any], field: str = "keys") -> list[BlockKey]:
    out = []
    for i, k in enumerate(_list(h, field)):
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise bad(f"{field}[{i}] must be {KEY_BYTES} bytes")
        out.append(BlockKey(k))
    return out


def req_ints(h: dict[str, Any], field: str, n: int | None = None) -> list[int]:
    return [_u64(v, f"{field}[{i}]") for i, v in enumerate(_list(h, field, n))]


def req_expects(h: dict[str, Any], n: int) -> list[Expect | None]:
    """``exp``: absent/nil, or n items each nil or ``[parent|nil, token_bytes|nil]``."""
    if h.get("exp") is None:
        return [None] * n
    out: list[Expect | None] = []
    for i, e in enumerate(_list(h, "exp", n)):
        if e is None:
            out.append(None)
            continue
        if not isinstance(e, list) or len(e) != 2:
            raise bad(f"exp[{i}] must be [parent, tokens]")
        parent, toks = e
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
            raise bad(f"exp[{i}] parent must be {KEY_BYTES} bytes or nil")
        if toks is not None and not isinstance(toks, bytes):
            raise bad(f"exp[{i}] tokens must be bytes or nil")
        out.append(Expect(BlockKey(parent) if parent is not None else None, toks))
    return out


def _expect_to_wire(e: Expect | None) -> list | None:
    return None if e is None else [e.parent.raw if e.parent else None, e.token_bytes]


def decode_header(raw: Any, name: str) -> BlockHeader:
    """One encoded block header (bytes); ProtocolError naming ``name`` when it does not parse."""
    if not isinstance(raw, bytes):
        raise bad(f"{name} must be an encoded block header (bytes)")
    try:
        return BlockHeader.decode(raw)
    except BlockFormatError as exc:
        raise bad(f"{name}: {exc}") from exc


def req_headers(h: dict[str, Any], field: str = "hdrs") -> list[BlockHeader]:
    return [decode_header(raw, f"{field}[{i}]") for i, raw in enumerate(_list(h, field))]


def req_descs(h: dict[str, Any], field: str = "descs") -> list[RemoteDescriptor]:
    return [_desc(raw, f"{field}[{i}]") for i, raw in enumerate(_list(h, field))]


def _desc(raw: Any, name: str, nil: bool = False) -> RemoteDescriptor | None:
    if raw is None and nil:
        return None
    try:
        return RemoteDescriptor.from_wire(raw)
    except TransportError as exc:
        raise bad(f"{name}: {exc}") from exc


def req_flag(h: dict[str, Any], field: str) -> bool:
    """An optional boolean field (absent or nil: False)."""
    v = h.get(field)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{field} must be true, false or nil, got {v!r}")
    return v


def req_float(h: dict[str, Any], field: str) -> float | None:
    """An optional number of seconds in (0, 86400]; None when absent or nil."""
    v = h.get(field)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86400:
        raise bad(f"{field} must be a number of seconds in (0, 86400], got {v!r}")
    return float(v)


def status_from_wire(v: Any, name: str = "status") -> Status:
    try:
        return Status(v)
    except (ValueError, TypeError) as exc:
        raise bad(f"{name}: unknown status {v!r}") from exc


def _bools(h: dict[str, Any], n: int | None) -> tuple[bool, ...]:
    res = _items(h, "res", n, 0)
    for i, r in enumerate(res):
        if not isinstance(r, bool):
            raise bad(f"res[{i}] must be true or false, got {r!r}")
    return tuple(res)


# ---------------------------------------------------------------- HELLO


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
                BAD_VERSION, f"protocol version {v!r} is not supported (this node speaks {PROTOCOL_VERSION})"
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
    ids (request order), the node's name and ``max_frame``, and ``rdma`` (None: inline)."""

    rid: int
    tenant: str
    salt: str
    ns: tuple[bytes, ...]
    node: str
    max_frame: int
    rdma: RdmaReply | None = None
    version: int = PROTOCOL_VERSION

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
        }

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> HelloReply:
        ns = _items(h, "ns", None, 0)
        if not all(isinstance(x, bytes) and len(x) == KEY_BYTES for x in ns):
            raise bad(f"ns must hold {KEY_BYTES}-byte namespace ids")
        max_frame = h.get("max_frame", 64 << 20)
        if _u64(max_frame, "max_frame") == 0:
            raise bad("max_frame must be positive")
        return cls(
            _u64(h.get("rid"), "rid"),
            _str(h.get("tenant"), "tenant"),
            _str(h.get("salt"), "salt"),
            tuple(ns),
            _str(h.get("node", ""), "node"),
            max_frame,
            RdmaReply.from_wire(h.get("rdma")),
            _u64(h.get("v"), "v"),
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


# ---------------------------------------------------------------- per-key records


@dataclass(frozen=True)
class GetEntry:
    """One key of a GET reply. ``header`` is the block's encoded header exactly as the node
    holds it (nil for a MISS); ``block`` is its decoded form, filled by :meth:`from_wire` (the
    reader's one decode) and None on the sending side."""

    status: Status
    header: bytes | None = None
    tier: str | None = None
    block: BlockHeader | None = field(default=None, compare=False, repr=False)

    def to_wire(self) -> list:
        return [int(self.status), self.header, self.tier]

    @classmethod
    def from_wire(cls, item: list, name: str) -> GetEntry:
        """``item``: ``[status, header|nil, tier|nil]`` (its length checked by the caller)."""
        status = status_from_wire(item[0], f"{name} status")
        raw, tier = item[1], _str(item[2], f"{name} tier", nil=True)
        block = None if raw is None else decode_header(raw, f"{name} header")
        if status is Status.HIT and block is None:
            raise bad(f"{name}: HIT without a header")
        return cls(status, raw, tier, block)


@dataclass(frozen=True)
class LeaseEntry(GetEntry):
    """One key of a LEASE reply: a :class:`GetEntry` and the descriptor of the held bytes
    (None: not held; a one-sided HIT without one is a block to GET inline)."""

    desc: RemoteDescriptor | None = None

    def to_wire(self) -> list:
        return [*super().to_wire(), self.desc.to_wire() if self.desc is not None else None]

    @classmethod
    def from_wire(cls, item: list, name: str) -> LeaseEntry:
        g = GetEntry.from_wire(item[:3], name)
        return cls(g.status, g.header, g.tier, g.block, _desc(item[3], f"{name} descriptor", nil=True))


@dataclass(frozen=True)
class ReserveEntry:
    """One header of a RESERVE reply: ``desc`` of a reserved slot (status None), or the
    ``status`` it got (EXISTS, NO_SPACE, INVALID, ...), or neither: PUT that block inline."""

    status: Status | None = None
    desc: RemoteDescriptor | None = None

    def to_wire(self) -> list:
        st = int(self.status) if self.status is not None else None
        return [st, self.desc.to_wire() if self.desc is not None else None]

    @classmethod
    def from_wire(cls, item: list, name: str) -> ReserveEntry:
        st = None if item[0] is None else status_from_wire(item[0], f"{name} status")
        desc = _desc(item[1], f"{name} descriptor", nil=True)
        if st is not None and desc is not None:
            raise bad(f"{name}: a status and a descriptor")
        return cls(st, desc)


def put_result_to_wire(r: PutResult) -> list:
    return [int(r.status), r.tier, bool(r.durable)]


def put_result_from_wire(item: list, name: str) -> PutResult:
    """``[status, tier|nil, durable]`` (length checked by the caller)."""
    if not isinstance(item[2], bool):
        raise bad(f"{name} durable must be true or false, got {item[2]!r}")
    return PutResult(
        status_from_wire(item[0], f"{name} status"), _str(item[1], f"{name} tier", nil=True), item[2]
    )


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class _KeysRequest:
    OP: ClassVar[str]
    rid: int
    keys: tuple[BlockKey, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "keys": [k.raw for k in self.keys]}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> Self:
        return cls(_u64(h.get("rid"), "rid"), tuple(req_keys(h)))


class ExistsRequest(_KeysRequest):
    OP = "EXISTS"


class DeleteRequest(_KeysRequest):
    OP = "DELETE"


@dataclass(frozen=True)
class _HandlesRequest:
    OP: ClassVar[str]
    rid: int
    handles: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "handles": list(self.handles)}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> Self:
        return cls(_u64(h.get("rid"), "rid"), tuple(req_ints(h, "handles")))


class ReleaseRequest(_HandlesRequest):
    OP = "RELEASE"


class CommitRequest(_HandlesRequest):
    OP = "COMMIT"


@dataclass(frozen=True)
class _DescsRequest:
    """READ or WRITE of descriptors (TCP only); a WRITE's payload is their bytes, in order."""

    OP: ClassVar[str]
    rid: int
    descs: tuple[RemoteDescriptor, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "descs": [d.to_wire() for d in self.descs]}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> Self:
        return cls(_u64(h.get("rid"), "rid"), tuple(req_descs(h)))


class ReadRequest(_DescsRequest):
    OP = "READ"


class WriteRequest(_DescsRequest):
    OP = "WRITE"


@dataclass(frozen=True)
class GetRequest:
    """``caps``: the caller's buffer size per key (None: unbounded); ``expects`` per key."""

    OP: ClassVar[str] = "GET"
    rid: int
    keys: tuple[BlockKey, ...]
    caps: tuple[int, ...] | None = None
    expects: tuple[Expect | None, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        exp = [_expect_to_wire(e) for e in self.expects]
        return {
            "op": self.OP,
            "rid": self.rid,
            "keys": [k.raw for k in self.keys],
            "caps": list(self.caps) if self.caps is not None else None,
            "exp": exp if any(e is not None for e in exp) else None,
        }

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> GetRequest:
        keys = req_keys(h)
        exp = req_expects(h, len(keys))
        caps = tuple(req_ints(h, "caps", len(keys))) if h.get("caps") is not None else None
        return cls(_u64(h.get("rid"), "rid"), tuple(keys), caps, tuple(exp))


@dataclass(frozen=True)
class PutRequest:
    """The payloads follow in header order, each exactly ``payload_len`` bytes."""

    OP: ClassVar[str] = "PUT"
    rid: int
    headers: tuple[BlockHeader, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "hdrs": [h.encode() for h in self.headers]}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> PutRequest:
        return cls(_u64(h.get("rid"), "rid"), tuple(req_headers(h)))


@dataclass(frozen=True)
class LeaseRequest:
    """``ttl``: seconds (None: the node's default); ``rdma``: one-sided descriptors."""

    OP: ClassVar[str] = "LEASE"
    rid: int
    keys: tuple[BlockKey, ...]
    ttl: float | None = None
    rdma: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP, "rid": self.rid, "keys": [k.raw for k in self.keys]}
        if self.ttl is not None:
            out["ttl"] = self.ttl
        if self.rdma:
            out["rdma"] = True
        return out

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> LeaseRequest:
        keys = req_keys(h)
        return cls(_u64(h.get("rid"), "rid"), tuple(keys), req_float(h, "ttl"), req_flag(h, "rdma"))


@dataclass(frozen=True)
class ReserveRequest:
    OP: ClassVar[str] = "RESERVE"
    rid: int
    headers: tuple[BlockHeader, ...]
    rdma: bool = False

    def to_wire(self) -> dict[str, Any]:
        out = {"op": self.OP, "rid": self.rid, "hdrs": [h.encode() for h in self.headers]}
        if self.rdma:
            out["rdma"] = True
        return out

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> ReserveRequest:
        hdrs = req_headers(h)
        return cls(_u64(h.get("rid"), "rid"), tuple(hdrs), req_flag(h, "rdma"))


@dataclass(frozen=True)
class StatsRequest:
    OP: ClassVar[str] = "STATS"
    rid: int

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> StatsRequest:
        return cls(_u64(h.get("rid"), "rid"))


REQUESTS: dict[str, Any] = {
    c.OP: c
    for c in (
        Hello,
        ExistsRequest,
        GetRequest,
        PutRequest,
        DeleteRequest,
        LeaseRequest,
        ReleaseRequest,
        ReadRequest,
        ReserveRequest,
        WriteRequest,
        CommitRequest,
        StatsRequest,
    )
}
OPS = frozenset(REQUESTS)
PAYLOAD_OPS = frozenset({PutRequest.OP, WriteRequest.OP})  # the requests a payload follows


# ---------------------------------------------------------------- replies
# ``from_wire(h, n)``: ``n`` is the number of results the request asked for (checked).


@dataclass(frozen=True)
class ExistsReply:
    """Per key, the highest tier holding it (``"hbm"``, ``"dram"``, ``"disk"``) or None."""

    rid: int
    tiers: tuple[str | None, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "tiers": list(self.tiers)}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> ExistsReply:
        tiers = _items(h, "tiers", n, 0)
        return cls(
            _u64(h.get("rid"), "rid"), tuple(_str(t, f"tiers[{i}]", nil=True) for i, t in enumerate(tiers))
        )


@dataclass(frozen=True)
class GetReply:
    """The HIT entries' payloads follow, in key order (``plen`` bytes, set when sending)."""

    rid: int
    entries: tuple[GetEntry, ...]
    plen: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> GetReply:
        res = _items(h, "res", n, 3)
        entries = tuple(GetEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(res))
        plen = payload_len(h)
        if plen != sum(e.block.payload_len for e in entries if e.status is Status.HIT):
            raise bad("GET reply payload length does not match its headers")
        return cls(_u64(h.get("rid"), "rid"), entries, plen)


@dataclass(frozen=True)
class PutReply:
    """Per block (PUT) or handle (COMMIT): status, tier, durable."""

    rid: int
    results: tuple[PutResult, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [put_result_to_wire(r) for r in self.results]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> Self:
        res = _items(h, "res", n, 3)
        return cls(
            _u64(h.get("rid"), "rid"), tuple(put_result_from_wire(x, f"res[{i}]") for i, x in enumerate(res))
        )


class CommitReply(PutReply):
    pass


@dataclass(frozen=True)
class _FlagsReply:
    """One true/false per key, handle or descriptor of the request."""

    rid: int
    res: tuple[bool, ...]
    plen: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": list(self.res)}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> Self:
        return cls(_u64(h.get("rid"), "rid"), _bools(h, n), payload_len(h))


class DeleteReply(_FlagsReply):
    """True where the key was stored (for this tenant) and is now gone."""


class ReleaseReply(_FlagsReply):
    """True where the handle was held."""


class ReadReply(_FlagsReply):
    """True where the descriptor's bytes follow (in order; ``plen`` bytes in all)."""


class WriteReply(_FlagsReply):
    """True where the descriptor's bytes were written."""


@dataclass(frozen=True)
class LeaseReply:
    rid: int
    entries: tuple[LeaseEntry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> LeaseReply:
        res = _items(h, "res", n, 4)
        return cls(
            _u64(h.get("rid"), "rid"), tuple(LeaseEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(res))
        )


@dataclass(frozen=True)
class ReserveReply:
    rid: int
    entries: tuple[ReserveEntry, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "res": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int) -> ReserveReply:
        res = _items(h, "res", n, 2)
        return cls(
            _u64(h.get("rid"), "rid"),
            tuple(ReserveEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(res)),
        )


@dataclass(frozen=True)
class StatsReply:
    """The counters the caller may see (docs/protocol.md, STATS)."""

    rid: int
    stats: dict[str, Any]

    @classmethod
    def of(
        cls,
        rid: int,
        tenant: str,
        connections: int,
        counters: dict[str, int],
        node: dict[str, Any] | None = None,
        daemon: dict[str, Any] | None = None,
    ) -> StatsReply:
        """``stats.tenant``: the caller's tenant, its open connections and its ``counters``;
        beside it (only without auth: one tenant) the node's ``stats()`` map and ``daemon``."""
        stats = dict(node or {})
        if daemon is not None:
            stats["daemon"] = daemon
        stats["tenant"] = {"tenant": tenant, "connections": connections, **counters}
        return cls(rid, stats)

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "ok": True, "stats": self.stats}

    @classmethod
    def from_wire(cls, h: dict[str, Any], n: int = 0) -> StatsReply:
        stats = h.get("stats") or {}
        if not isinstance(stats, dict):
            raise bad(f"stats must be a map, got {type(stats).__name__}")
        return cls(_u64(h.get("rid"), "rid"), stats)
