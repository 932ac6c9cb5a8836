"""Per-key result records of LEASE, RESERVE and PUT/COMMIT replies (a GET reply is columns:
kvstore/protocol/replies.py ``GetReply``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.block import BlockHeader
from kvstore.lookups import ABSENT, TIER_CODES, TIER_NAMES
from kvstore.protocol.fields import _desc, _str, bad, decode_header, status_from_wire
from kvstore.results import PutResult, Status
from rdma.transport import RemoteDescriptor


@dataclass(frozen=True)
class LeaseEntry:
    """One key of a LEASE reply. ``header`` is the block's encoded header exactly as the node
    holds it (nil for a MISS); ``block`` is its decoded form, filled by :meth:`from_wire` (the
    reader's one decode) and None on the sending side; ``desc`` the descriptor of the held
    bytes (None: not held; a one-sided HIT without one is a block to GET inline)."""

    status: Status
    header: bytes | None = None
    tier: str | None = None
    block: BlockHeader | None = field(default=None, compare=False, repr=False)
    desc: RemoteDescriptor | None = None

    def to_wire(self) -> list:
        return [
            int(self.status),
            self.header,
            self.tier,
            self.desc.to_wire() if self.desc is not None else None,
        ]

    @classmethod
    def from_wire(cls, item: list, name: str) -> LeaseEntry:
        """``item``: ``[status, header|nil, tier|nil, descriptor|nil]`` (its length checked by
        the caller)."""
        status = status_from_wire(item[0], f"{name} status")
        raw, tier = item[1], _str(item[2], f"{name} tier", nil=True)
        block = None if raw is None else decode_header(raw, f"{name} header")
        if status is Status.HIT and block is None:
            raise bad(f"{name}: HIT without a header")
        return cls(status, raw, tier, block, _desc(item[3], f"{name} descriptor", nil=True))


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


# the tier of a PUT/COMMIT result as one byte (docs/protocol.md): 0 none, then these
# the tier byte of a PUT reply is the lookup tier code (kvstore.lookups: one table for both)
PUT_TIERS: tuple[str | None, ...] = (None, *TIER_NAMES)
_PUT_TIER_CODE = {None: ABSENT, **TIER_CODES}
_STATUSES = frozenset(int(s) for s in Status)
# every (status, tier, durable) byte triple's result, made once: a reply of n blocks becomes
# its results by one C-level map over its three byte strings, not n constructions
_PUT_RESULT_OF = {
    (int(st), t, d): PutResult(st, PUT_TIERS[t], bool(d))
    for st in Status
    for t in range(len(PUT_TIERS))
    for d in (0, 1)
}


def put_results_to_wire(results: tuple[PutResult, ...]) -> dict[str, bytes]:
    """``st``, ``tier``, ``dur``: one byte per block each (status code, tier code, 0/1)."""
    return {
        "st": bytes(int(r.status) for r in results),
        "tier": bytes(_PUT_TIER_CODE.get(r.tier, 0) for r in results),
        "dur": bytes(bool(r.durable) for r in results),
    }


def put_results_from_wire(h: dict, n: int) -> tuple[PutResult, ...]:
    """The inverse of :func:`put_results_to_wire`, each field checked (length ``n``, codes)."""
    cols = []
    for name, ok in (("st", _STATUSES), ("tier", range(len(PUT_TIERS))), ("dur", (0, 1))):
        v = h.get(name)
        if not isinstance(v, bytes) or len(v) != n:
            raise bad(
                f"{name} must be {n} bytes, got {type(v).__name__} of {len(v) if isinstance(v, bytes) else '?'}"
            )
        bad_codes = set(v) - set(ok)
        if bad_codes:
            raise bad(f"{name}[{v.index(min(bad_codes))}]: unknown code {min(bad_codes)}")
        cols.append(v)
    st, tier, dur = cols
    return tuple(map(_PUT_RESULT_OF.__getitem__, zip(st, tier, dur)))
