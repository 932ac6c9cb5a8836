"""The outcome of one key of a batched operation (:class:`Status`), its integer values part of
the wire protocol (docs/protocol.md). Its own module so that kvstore.block, which judges a
block a reader received (:func:`kvstore.block.check_block`), and kvstore.results, whose
records carry headers, both use it without importing each other."""

from __future__ import annotations

import enum


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
    # write, a peer session's PUT only (another node's repair): this node deleted the key after
    # the pushed copy was written (its tombstone is newer than the header's ``created``);
    # nothing stored, and the pusher may drop its copy (docs/cluster.md)
    DELETED = 12

    @property
    def ok(self) -> bool:
        return self in (Status.HIT, Status.STORED, Status.EXISTS)
