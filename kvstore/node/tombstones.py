"""Tombstones: the keys a node deleted, so a copy coming back from a node that was away while
they were deleted is not taken in again (docs/cluster.md, "Evictions that stick").

Contract: :class:`Tombstones` holds, per deleted key, when it was deleted (wall clock). A
key's tombstone ends when the key is written again by a client (:meth:`discard`: a fresh
write revives it), when it is older than ``max_age_s``, or when more than ``max_entries``
are held (the oldest go first): bounded in size and age. With a ``path`` (a side file beside
the node's LMDB environment) every change is appended to that file as fixed 24-byte records
(16-byte key, 8-byte time; time 0 revives the key) and replayed at open, so tombstones outlive a
restart, kill -9 included; the file is rewritten when it holds more than twice the live
records. Without a path (no disk tier: a restart forgets every block anyway) they are in
memory only. A file that cannot be read or has a torn last record keeps what it could read
(logged); one that cannot be written turns tombstones in-memory only (logged once). Never raises
for an I/O problem. The daemon's peer PUT (kvstore/daemon/block_ops.py) refuses another node's repair
push of a copy older than the tombstone with DELETED (:meth:`refuses`); the repair then drops
that copy, writing no tombstone of its own (kvstore/client/repair.py).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("kvstore.node")
_RECORD = struct.Struct("<16sd")
FILE_NAME = "tombstones.bin"


class Tombstones:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        max_entries: int = 1 << 18,
        max_age_s: float = 7 * 86400.0,
    ) -> None:
        if max_entries < 1 or not max_age_s > 0:
            raise ValueError(
                f"tombstones: max_entries >= 1 and max_age_s > 0, got {max_entries}, {max_age_s}"
            )
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.path = Path(path) if path is not None else None
        self._dead: OrderedDict[bytes, float] = OrderedDict()  # oldest first
        self._records = 0  # records in the file
        self._file = None
        if self.path is not None:
            self._load()
            self._rewrite()

    @classmethod
    def beside(cls, directory: str | os.PathLike | None) -> Tombstones:
        """Tombstones kept in ``directory`` (the disk tier's LMDB directory), or in memory only
        when None or empty (no disk tier)."""
        return cls(Path(directory) / FILE_NAME if directory else None)

    def __len__(self) -> int:
        self._expire()
        return len(self._dead)

    def __contains__(self, key: bytes) -> bool:
        t = self._dead.get(key)
        return t is not None and time.time() - t < self.max_age_s

    def deleted_at(self, key: bytes) -> float | None:
        """When this node deleted ``key`` (wall clock), None without a live tombstone."""
        t = self._dead.get(key)
        return t if t is not None and time.time() - t < self.max_age_s else None

    def refuses(self, key: bytes, created: float) -> bool:
        """Whether a peer's copy of ``key`` written at ``created`` (its header's wall clock)
        predates this node's delete of it: then the copy is what was deleted, and it is not
        taken in again. A copy written after the delete (the key stored again elsewhere) is."""
        t = self.deleted_at(key)
        return t is not None and t >= created

    def add(self, keys: Iterable[bytes]) -> None:
        """Tombstone ``keys`` (16-byte raw keys), now."""
        now = time.time()
        recs = []
        for k in keys:
            self._dead.pop(k, None)
            self._dead[k] = now
            recs.append(_RECORD.pack(k, now))
        self._trim()
        self._append(recs)

    def discard(self, keys: Iterable[bytes]) -> None:
        """``keys`` were written again: they are alive."""
        recs = [_RECORD.pack(k, 0.0) for k in keys if self._dead.pop(k, None) is not None]
        self._append(recs)

    # ------------------------------------------------------------ bounds and the side file

    def _expire(self) -> None:
        cut = time.time() - self.max_age_s
        while self._dead:
            k, t = next(iter(self._dead.items()))
            if t >= cut:
                break
            del self._dead[k]

    def _trim(self) -> None:
        self._expire()
        while len(self._dead) > self.max_entries:
            self._dead.popitem(last=False)

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()  # type: ignore[union-attr]
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("event=tombstones_unreadable path=%s error=%r", self.path, exc)
            return
        whole = len(data) - len(data) % _RECORD.size
        if whole != len(data):
            log.warning("event=tombstones_torn_record path=%s bytes=%d", self.path, len(data) - whole)
        entries: dict[bytes, float] = {}
        for k, t in _RECORD.iter_unpack(data[:whole]):
            if t:
                entries.pop(k, None)
                entries[k] = t
            else:
                entries.pop(k, None)
        for k, t in sorted(entries.items(), key=lambda kv: kv[1]):
            self._dead[k] = t
        self._trim()

    def _rewrite(self) -> None:
        """The file holds exactly the live tombstones (written aside, then renamed)."""
        if self.path is None:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(_RECORD.pack(k, t) for k, t in self._dead.items()))
            os.replace(tmp, self.path)
            self._file = open(self.path, "ab")  # noqa: SIM115 -- kept open; closed in close()
        except OSError as exc:
            log.warning("event=tombstones_not_persisted path=%s error=%r", self.path, exc)
            self.path = None
            return
        self._records = len(self._dead)

    def _append(self, recs: list[bytes]) -> None:
        if not recs or self._file is None:
            return
        try:
            self._file.write(b"".join(recs))
            self._file.flush()  # in the OS's hands: survives a kill -9 of the daemon
        except OSError as exc:
            log.warning("event=tombstones_not_persisted path=%s error=%r", self.path, exc)
            self._file = None
            return
        self._records += len(recs)
        if self._records > 2 * len(self._dead) + 4096:
            self._rewrite()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
