"""Per-key results of the store's batched operations, shared by tiers, node, daemon and client.

Every batched call returns one result per input key, in input order; a failure of one key
never fails the batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.block import BlockHeader
from kvstore.keys import BlockKey


class Status(enum.IntEnum):
    """Outcome of one key in a batch. The integer values are part of the wire protocol."""

    HIT = 0  # read: payload delivered and verified
    MISS = 1  # read: not stored (or not visible to this tenant)
    CORRUPT = 2  # read: stored copy failed its checksum; it was dropped
    MISMATCH = 3  # read: key matched but parent or token ids did not (collision / stale)
    BUF_TOO_SMALL = 4  # read: the caller's buffer is shorter than the payload
    STORED = 5  # write: stored
    EXISTS = 6  # write: an identical block was already stored; nothing written
    NO_SPACE = 7  # write: no tier could take it without evicting leased or pinned blocks
    BUSY = 8  # write/delete: the key is leased by a reader; try later
    INVALID = 9  # write: header does not describe the payload (length, checksum)
    ERROR = 10  # an internal error (I/O); counted and logged
    TIMEOUT = 11  # client side: the deadline passed

    @property
    def ok(self) -> bool:
        return self in (Status.HIT, Status.STORED, Status.EXISTS)


@dataclass(frozen=True, slots=True)
class Expect:
    """What a reader expects of a block beside its key; either field may be None (unchecked)."""

    parent: BlockKey | None = None
    token_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class GetResult:
    status: Status
    header: BlockHeader | None = None
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class PutResult:
    status: Status
    tier: str | None = None
    durable: bool = False  # True once the block is committed (and synced, if configured) on disk


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the node knows of a block without reading it (for listings and the admin API)."""

    key: BlockKey
    namespace: BlockKey
    tiers: tuple[str, ...]
    payload_len: int
    num_tokens: int
    created: float
    last_access: float
    leases: int
    pinned: bool
