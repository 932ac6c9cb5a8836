"""The data-port protocol: operations, versioning, limits and the validation of each field.

A frame is ``[u32 header length][msgpack map][raw payload]`` (framing and the zero-copy socket
I/O live in :mod:`rdma.tcp`); this module says what the maps contain. Every request carries
``op`` and ``rid`` (echoed in the reply); replies carry ``ok`` and, when false, ``code`` and
``err``. docs/protocol.md specifies every frame. Parsers here raise :class:`ProtocolError`
naming the bad field; they never touch sockets and are thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError, KeyFormatError, TierKVError
from kvstore.keys import KEY_BYTES, BlockKey, Namespace
from kvstore.results import Expect, Status
from rdma.transport import QPInfo, Region, TransportError

PROTOCOL_VERSION = 1
MAX_HEADER = 4 << 20  # request header maps; 256 block headers of 1024 tokens each fit
MAX_BATCH = 4096  # keys (or descriptors, handles) per request
MAX_BLOCKS = 256  # block headers per GET/PUT frame that clients send; keeps headers under MAX_HEADER
MAX_REPLY_HEADER = 16 << 20  # what a client accepts from a node

OPS = frozenset(
    {
        "HELLO",
        "EXISTS",
        "GET",
        "PUT",
        "DELETE",
        "LEASE",
        "RELEASE",
        "READ",
        "RESERVE",
        "WRITE",
        "COMMIT",
        "STATS",
    }
)

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


def error_reply(rid: Any, code: str, message: str) -> dict[str, Any]:
    return {"rid": rid if isinstance(rid, int) else 0, "ok": False, "code": code, "err": message}


# ---------------------------------------------------------------- field parsers


def req_op(h: dict[str, Any]) -> tuple[str, int]:
    """``(op, rid)`` of a request map; ProtocolError for a missing rid or an unknown op."""
    rid = h.get("rid")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < 2**64:
        raise bad(f"rid must be a u64, got {rid!r}")
    op = h.get("op")
    if not isinstance(op, str) or op not in OPS:  # a list or map is unhashable: check the type first
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}")
    return op, rid


def _list(h: dict[str, Any], field: str, n: int | None = None) -> list:
    v = h.get(field)
    if not isinstance(v, list):
        raise bad(f"{field} must be a list, got {type(v).__name__}")
    if len(v) > MAX_BATCH:
        raise bad(f"{field} has {len(v)} items; at most {MAX_BATCH} per request")
    if n is not None and len(v) != n:
        raise bad(f"{field} has {len(v)} items, expected {n}")
    return v


def _uint(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**64:
        raise bad(f"{name} must be a u64, got {v!r}")
    return v


def req_keys(h: dict[str, Any], field: str = "keys") -> list[BlockKey]:
    out = []
    for i, k in enumerate(_list(h, field)):
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise bad(f"{field}[{i}] must be {KEY_BYTES} bytes")
        out.append(BlockKey(k))
    return out


def req_ints(h: dict[str, Any], field: str, n: int | None = None) -> list[int]:
    return [_uint(v, f"{field}[{i}]") for i, v in enumerate(_list(h, field, n))]


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


def req_headers(h: dict[str, Any], field: str = "hdrs") -> list[BlockHeader]:
    out = []
    for i, raw in enumerate(_list(h, field)):
        if not isinstance(raw, bytes):
            raise bad(f"{field}[{i}] must be an encoded block header (bytes)")
        try:
            out.append(BlockHeader.decode(raw))
        except BlockFormatError as exc:
            raise bad(f"{field}[{i}]: {exc}") from exc
    return out


def req_flag(h: dict[str, Any], field: str) -> bool:
    """An optional boolean field (absent or nil: False)."""
    v = h.get(field)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{field} must be true, false or nil, got {v!r}")
    return v


def req_float(h: dict[str, Any], field: str, default: float | None) -> float | None:
    v = h.get(field, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86400:
        raise bad(f"{field} must be a number of seconds in (0, 86400], got {v!r}")
    return float(v)


# ---------------------------------------------------------------- HELLO


@dataclass(frozen=True)
class Hello:
    """A parsed HELLO request. ``namespaces`` carry no tenant salt: the daemon adds the salt of
    the tenant the token authenticates, never the one the client claims."""

    version: int
    token: str
    tenant: str | None
    namespaces: tuple[Namespace, ...]
    rdma: QPInfo | None = None  # the client's queue pair, when it offers RDMA


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


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise bad(f"{name} must be a string, got {type(v).__name__}")
    return v


def parse_hello(h: dict[str, Any]) -> Hello:
    """Parse a HELLO map. ProtocolError ``bad_version`` for another protocol version,
    ``bad_request`` for a malformed field (``rdma``: QP info that :meth:`QPInfo.from_wire`
    refuses). Namespaces are checked later, with the salt."""
    v = h.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            BAD_VERSION, f"protocol version {v!r} is not supported (this node speaks {PROTOCOL_VERSION})"
        )
    token = h.get("token", "")
    tenant = h.get("tenant")
    if not isinstance(token, str):
        raise bad("token must be a string")
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
    return Hello(v, token, tenant, tuple(ns), qp)


# ---------------------------------------------------------------- per-key results


def get_result_to_wire(status: Status, header: BlockHeader | None, tier: str | None) -> list:
    return [int(status), header.encode() if header is not None else None, tier]


def get_result_from_wire(item: Any) -> tuple[Status, BlockHeader | None, str | None]:
    """Parse one GET/LEASE result; raises ProtocolError (the reply cannot be trusted)."""
    if not isinstance(item, list) or len(item) != 3:
        raise bad(f"GET result must be [status, header, tier], got {item!r}")
    st, raw, tier = item
    status = status_from_wire(st)
    header = None
    if raw is not None:
        if not isinstance(raw, bytes):
            raise bad("GET result header must be bytes")
        try:
            header = BlockHeader.decode(raw)
        except BlockFormatError as exc:
            raise bad(f"GET result header: {exc}") from exc
    if tier is not None and not isinstance(tier, str):
        raise bad("GET result tier must be a string")
    if status is Status.HIT and header is None:
        raise bad("GET HIT without a header")
    return status, header, tier


def status_from_wire(v: Any) -> Status:
    try:
        return Status(v)
    except ValueError as exc:
        raise bad(f"unknown status {v!r}") from exc
