"""Protocol constants, error codes, ProtocolError and the field parsers every message uses."""

from __future__ import annotations

import struct
from typing import Any

from kvstore.block import BlockHeader
from kvstore.errors import BlockFormatError, KeyFormatError, TierKVError
from kvstore.keys import KEY_BYTES, KeyBatch
from kvstore.results import Status
from rdma.transport import RemoteDescriptor, TransportError

# 2: EXISTS and DELETE carry packed keys and one code byte per key; 3: a peer PUT of a key
# the node deleted after the copy was written answers DELETED (12), not MISS; 4: a GET
# carries keys (and caps) only, its reply is columns (docs/protocol.md, Versioning)
PROTOCOL_VERSION = 4
MAX_HEADER = 4 << 20  # request header maps; 256 block headers of 1024 tokens each fit
MAX_BATCH = 4096  # keys (or descriptors, handles) per request
# keys per EXISTS (one packed bin: 256 KiB of keys, 16 KiB of answers): a 128K-token
# prompt's share of one node in one request. A node says its own in HELLO (``exists_keys``);
# a node that does not say it takes MAX_BATCH, as before the field existed.
MAX_EXISTS_KEYS = 16384
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


def request_rid(h: dict[str, Any]) -> int:
    """The rid an error reply to ``h`` echoes: the request's when it is an int, else 0."""
    rid = h.get("rid")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def req_key_batch(h: dict[str, Any], field: str = "keys", most: int = MAX_BATCH) -> KeyBatch:
    """A packed key field: one bin of ``n × 16`` bytes, ``n <= most`` (one length check)."""
    v = h.get(field)
    if not isinstance(v, bytes):
        raise bad(f"{field} must be bin (n x {KEY_BYTES} bytes), got {type(v).__name__}")
    try:
        return KeyBatch(v, max_keys=most)
    except KeyFormatError as exc:
        raise bad(f"{field}: {exc}") from exc


def codes_from_wire(h: dict[str, Any], field: str, n: int, top: int) -> bytes:
    """A per-key code field: one bin of exactly ``n`` bytes, each at most ``top``."""
    v = h.get(field)
    if not isinstance(v, bytes) or len(v) != n:
        raise bad(f"{field} must be bin of {n} bytes (one per key), got {v!r:.80}")
    if v.translate(None, bytes(range(top + 1))):  # one C pass: a byte over ``top`` is left
        at = next(i for i, c in enumerate(v) if c > top)
        raise bad(f"{field}[{at}] is {v[at]}; codes are 0..{top}")
    return v


def req_caps(h: dict[str, Any], n: int) -> tuple[int, ...] | None:
    """``caps``: absent/nil, or one bin of ``n × 8`` bytes (little-endian u64 per key)."""
    v = h.get("caps")
    if v is None:
        return None
    if not isinstance(v, bytes) or len(v) != 8 * n:
        raise bad(f"caps must be bin of {8 * n} bytes (u64 little-endian per key), got {v!r:.80}")
    return struct.unpack(f"<{n}Q", v)


def caps_to_wire(caps: tuple[int, ...] | None) -> bytes | None:
    if caps is None:
        return None
    return struct.pack(f"<{len(caps)}Q", *caps)


def req_ints(h: dict[str, Any], field: str, n: int | None = None) -> list[int]:
    return [_u64(v, f"{field}[{i}]") for i, v in enumerate(_list(h, field, n))]


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
