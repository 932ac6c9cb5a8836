"""One frozen request type per op (to_wire / from_wire) and the op table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from kvstore.block import BlockHeader
from kvstore.keys import KeyBatch
from kvstore.protocol.fields import (
    MAX_BATCH,
    MAX_EXISTS_KEYS,
    UNKNOWN_OP,
    ProtocolError,
    _u64,
    bad,
    caps_to_wire,
    req_caps,
    req_descs,
    req_flag,
    req_float,
    req_headers,
    req_ints,
    req_key_batch,
)
from kvstore.protocol.hello import Hello
from rdma.transport import RemoteDescriptor


@dataclass(frozen=True)
class _KeysRequest:
    """EXISTS or DELETE: ``keys`` packed (a :class:`KeyBatch`; BlockKeys given are packed),
    sent as one bin field of ``n × 16`` bytes."""

    OP: ClassVar[str]
    MOST: ClassVar[int] = MAX_BATCH  # keys one request may carry
    rid: int
    keys: KeyBatch

    def __post_init__(self) -> None:
        if not isinstance(self.keys, KeyBatch):
            object.__setattr__(self, "keys", KeyBatch.of(self.keys))

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "keys": self.keys.raw}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> Self:
        return cls(_u64(h.get("rid"), "rid"), req_key_batch(h, most=cls.MOST))


class ExistsRequest(_KeysRequest):
    OP = "EXISTS"
    MOST = MAX_EXISTS_KEYS


class DeleteRequest(_KeysRequest):
    OP = "DELETE"
    MOST = MAX_EXISTS_KEYS  # "exactly as EXISTS" (docs/protocol.md): a prompt's keys at once


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
    """``keys`` packed (a :class:`KeyBatch`; BlockKeys given are packed), one bin field;
    ``caps``: the caller's buffer size per key (None: unbounded), one bin of u64 LE per key.
    Nothing else: the keys imply the blocks' parents and tokens, and the client judges every
    header it receives (:func:`kvstore.block.check_block`). A request with ``exp`` (a
    protocol 3 field) is refused, naming it, rather than served unchecked."""

    OP: ClassVar[str] = "GET"
    rid: int
    keys: KeyBatch
    caps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keys, KeyBatch):
            object.__setattr__(self, "keys", KeyBatch.of(self.keys))

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "rid": self.rid, "keys": self.keys.raw, "caps": caps_to_wire(self.caps)}

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> GetRequest:
        if h.get("exp") is not None:
            raise bad("exp: a GET carries keys only since protocol 4 (the client checks each header)")
        keys = req_key_batch(h)
        return cls(_u64(h.get("rid"), "rid"), keys, req_caps(h, len(keys)))


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
    """``keys`` packed as GET's; ``ttl``: seconds (None: the node's default); ``rdma``:
    one-sided descriptors."""

    OP: ClassVar[str] = "LEASE"
    rid: int
    keys: KeyBatch
    ttl: float | None = None
    rdma: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keys, KeyBatch):
            object.__setattr__(self, "keys", KeyBatch.of(self.keys))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP, "rid": self.rid, "keys": self.keys.raw}
        if self.ttl is not None:
            out["ttl"] = self.ttl
        if self.rdma:
            out["rdma"] = True
        return out

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> LeaseRequest:
        keys = req_key_batch(h)
        return cls(_u64(h.get("rid"), "rid"), keys, req_float(h, "ttl"), req_flag(h, "rdma"))


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


def req_op(h: dict[str, Any]) -> tuple[str, int]:
    """``(op, rid)`` of a request map; ProtocolError for a missing rid or an unknown op."""
    rid = _u64(h.get("rid"), "rid")
    op = h.get("op")
    if not isinstance(op, str) or op not in REQUESTS:  # a list or map is unhashable: type first
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}")
    return op, rid


OPS = frozenset(REQUESTS)
PAYLOAD_OPS = frozenset({PutRequest.OP, WriteRequest.OP})  # the requests a payload follows
