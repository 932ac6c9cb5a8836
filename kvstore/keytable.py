"""A bounded map from 16-byte block keys to small ints, probed and filled a whole batch at once.

Contract: :class:`KeyTable` maps keys (rows of :func:`key_pairs`: each key's 16 bytes as two
uint64) to values in ``[0, 2**31)``. :meth:`~KeyTable.find`, :meth:`~KeyTable.insert` and
:meth:`~KeyTable.remove` take a whole batch and run as a few numpy passes, never Python per
key: a lookup of 8,192 keys probes its rank cache and miss hints this way
(kvstore/client/lookup.py). A key is found only when all 16 of its bytes equal a stored
key's. It holds at most ``max_entries`` live keys (an insert past that is a ValueError: its
owner decides what to drop, see :class:`~kvstore.client.placement.RankCache` and
:class:`~kvstore.client.lookup.MissHints`). The node's tier index keeps one beside its dict
(kvstore/node/tiers/index.py), so the daemon's EXISTS probes a batch the same way.

How: the keys live in an entry log, in the order they were inserted (a batch's new keys in
batch order), and an open-addressing index (linear probing, at most a quarter full, a
multiply-shift hash with a random odd multiplier per table) maps a key to its entry. A
prompt's keys are inserted together and asked again together, in the same order, so a probe
first asks the index for a few anchor keys only (one every ``_RUN`` keys) and guesses that
the keys after each anchor follow it in the log: those guesses are checked against the
log's keys as whole runs (sequential memory, cheap even right after other processes had the
core and the cache), and only the keys no guess found go through the index (random memory:
the expensive part). A removed key's entry is marked dead (the index passes over it); the
log and index are rebuilt from the live entries (larger, when they need it) when either
would fill up.
"""

from __future__ import annotations

import secrets

import numpy as np

from kvstore.keys import KEY_BYTES, KeyBatch

_MIN_BITS = 10  # the smallest index: 1,024 slots
_RUN = 256  # keys per anchor when guessing runs
_WINDOW = 8  # index slots read per key and pass after the first (see KeyTable._probe)
_FILTER_BITS = 2  # the filter has 2**_FILTER_BITS cells per index slot (see KeyTable._probe)


def key_pairs(keys: KeyBatch) -> np.ndarray:
    """``keys`` as an ``(n, 2)`` uint64 view of their bytes (no copy)."""
    return np.frombuffer(keys.raw, dtype="<u8").reshape(len(keys), KEY_BYTES // 8)


class KeyTable:
    """Block keys to small ints, at most ``max_entries`` live keys; see the module docstring."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"key table max_entries must be >= 1, got {max_entries}")
        self._max = max_entries
        self._top = max(_MIN_BITS, (4 * max_entries - 1).bit_length())  # index: 4x max_entries at most
        self._mul = np.uint64(secrets.randbits(64) | 1)
        self._alloc(_MIN_BITS, 1 << (_MIN_BITS - 2))

    def _alloc(self, bits: int, entries: int) -> None:
        self._bits = bits
        self._shift = np.uint64(64 - bits - _FILTER_BITS)
        self._slot = np.zeros(1 << bits, dtype=np.int32)  # entry index + 1; 0: empty
        # per cell of the hash's top bits + _FILTER_BITS: whether a key indexed since the
        # last _alloc hashes there (never unset: a removed key's cell stays, which only costs
        # a probe). An absent key whose cell is unset is answered without reading the index.
        self._filter = np.zeros(1 << (bits + _FILTER_BITS), dtype=bool)
        self._hi = np.zeros(entries, dtype=np.uint64)
        self._lo = np.zeros(entries, dtype=np.uint64)
        self._val = np.zeros(entries, dtype=np.int32)
        self._alive = np.zeros(entries, dtype=bool)
        self._n = 0  # entries used (live and dead)
        self.added = 0  # new keys ever inserted: while it stands still, no key joined
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @property
    def max_entries(self) -> int:
        return self._max

    def live_pairs(self) -> np.ndarray:
        """Every stored key as an ``(n, 2)`` uint64 row, as :func:`key_pairs` gives them, in
        log order (a copy: numpy passes only)."""
        at = np.flatnonzero(self._alive[: self._n])
        return np.stack((self._hi.take(at), self._lo.take(at)), axis=1)

    def clear(self) -> None:
        if self._n:
            self._alloc(_MIN_BITS, 1 << (_MIN_BITS - 2))

    # ------------------------------------------------------------------ probes

    def _cell(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """The key's filter cell: the top ``bits + _FILTER_BITS`` bits of its hash."""
        return (((hi ^ lo) * self._mul) >> self._shift).astype(np.int64)

    def _probe(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Per key its live entry through the index, else -1 (``take``, not fancy indexing:
        several times faster for gathers of this size). Keys whose filter cell is unset are
        absent without reading the index (at most 1 in 16 cells is set: most absent keys
        end here). A key's run of the index is read one slot in the first pass (most keys
        end there: the index is at most a quarter full), then in windows of ``_WINDOW``
        slots per key, so the few long runs cost a pass or two rather than one pass per
        slot."""
        out = np.full(len(hi), -1, dtype=np.int64)
        if not self._live or not len(hi):
            return out
        mask = (1 << self._bits) - 1
        cell = self._cell(hi, lo)
        idx = np.flatnonzero(self._filter.take(cell))
        if len(idx) < len(hi):
            hi, lo, cell = hi.take(idx), lo.take(idx), cell.take(idx)
        s = cell >> _FILTER_BITS
        e = self._slot.take(s).astype(np.int64) - 1
        used = e >= 0
        at = np.maximum(e, 0)
        hit = used & (self._hi.take(at) == hi) & (self._lo.take(at) == lo) & self._alive.take(at)
        out[idx[hit]] = e[hit]
        more = np.flatnonzero(used & ~hit)  # a run goes on past other keys and dead entries
        idx, s, hi, lo = idx.take(more), (s.take(more) + 1) & mask, hi.take(more), lo.take(more)
        step = np.arange(_WINDOW)
        while len(idx):
            win = (s[:, None] + step) & mask  # the next _WINDOW slots of each key's run
            e = self._slot.take(win).astype(np.int64) - 1
            used = e >= 0
            at = np.maximum(e, 0)
            hit = used & (self._hi.take(at) == hi[:, None]) & (self._lo.take(at) == lo[:, None])
            hit &= self._alive.take(at)
            stop = hit | ~used  # a key's answer is its window's first hit or empty slot
            ended = stop.any(axis=1)
            first = stop.argmax(axis=1)
            rows = np.flatnonzero(ended)
            found = rows[hit[rows, first[rows]]]
            out[idx.take(found)] = e[found, first[found]]
            more = np.flatnonzero(~ended)
            idx, s, hi, lo = idx.take(more), (s.take(more) + _WINDOW) & mask, hi.take(more), lo.take(more)
        return out

    def _entries(self, pairs: np.ndarray) -> np.ndarray:
        """Per key its live entry, else -1: runs guessed from anchors, the rest probed."""
        n = len(pairs)
        hi, lo = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
        if not self._live or not n:
            return np.full(n, -1, dtype=np.int64)
        anchors = np.arange(0, n, _RUN)
        at = self._probe(hi.take(anchors), lo.take(anchors))
        first = int(at[0])
        if first >= 0 and first + n <= self._n and (at == first + anchors).all():
            # the whole batch sits in the log in order (a prompt asked again): compare it
            # as one slice of each column, no gather
            end = first + n
            ok = (self._hi[first:end] == hi) & (self._lo[first:end] == lo) & self._alive[first:end]
            if ok.all():
                return np.arange(first, end)
        guess = np.repeat(at, _RUN)[:n]
        offset = np.arange(n) - np.repeat(anchors, _RUN)[:n]
        guess = np.where((guess >= 0) & (guess + offset < self._n), guess + offset, -1)
        g = np.maximum(guess, 0)
        ok = (guess >= 0) & (self._hi.take(g) == hi) & (self._lo.take(g) == lo) & self._alive.take(g)
        out = np.where(ok, guess, -1)
        rest = np.flatnonzero(~ok)
        if len(rest):
            out[rest] = self._probe(hi.take(rest), lo.take(rest))
        return out

    def find(self, pairs: np.ndarray) -> np.ndarray:
        """Per key (rows of ``pairs``) its value, -1 where absent (int64)."""
        at = self._entries(pairs)
        return np.where(at >= 0, self._val.take(np.maximum(at, 0)), -1)

    def find_each(self, pairs: np.ndarray) -> np.ndarray:
        """:meth:`find` without the run guess: each key through the index, so a stored key
        costs what an absent one does (a tenant check whose timing must not tell another
        tenant's key from an absent one, kvstore.node.tiers.index.LruIndex.probe)."""
        at = self._probe(np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1]))
        return np.where(at >= 0, self._val.take(np.maximum(at, 0)), -1)

    # ------------------------------------------------------------------ changes

    def insert(self, pairs: np.ndarray, values: np.ndarray) -> None:
        """Set each key's value (``0 <= value < 2**31``; a key already stored, or repeated in
        ``pairs``, takes one of its values given). New keys join the log in batch order.
        ValueError when the live keys could exceed ``max_entries``."""
        n = len(pairs)
        if not n:
            return
        values = np.asarray(values, dtype=np.int64)
        if len(values) != n or values.min() < 0 or values.max() >= 1 << 31:
            raise ValueError(f"key table: {n} values in [0, 2**31) expected")
        have = self._entries(pairs)
        old = have >= 0
        new = np.flatnonzero(~old)
        if self._live + len(new) > self._max:
            raise ValueError(f"key table: {self._live} + {len(new)} keys is over max_entries {self._max}")
        self._val[have[old]] = values[old]
        k = len(new)
        if not k:
            return
        self.added += k
        if self._n + k > len(self._hi) or 4 * (self._n + k) > 1 << self._bits:
            self._rebuild(self._live + k)
        first = self._n
        e = np.arange(first, first + k)
        self._hi[e], self._lo[e] = pairs[new, 0], pairs[new, 1]
        self._val[e] = values[new]
        self._alive[e] = True
        self._n += k
        self._live += k
        self._index(e, dedupe=True)

    def _index(self, e: np.ndarray, dedupe: bool) -> None:
        """Put entries ``e`` (live, in the log) into the index. ``dedupe``: an entry whose key
        another live entry of the index has already (a key repeated in one insert) is marked
        dead instead, its value given to that entry."""
        mask = (1 << self._bits) - 1
        hi, lo = self._hi.take(e), self._lo.take(e)
        cell = self._cell(hi, lo)
        self._filter[cell] = True
        s = cell >> _FILTER_BITS
        while len(e):
            cur = self._slot.take(s).astype(np.int64) - 1
            used = cur >= 0
            keep = np.ones(len(e), dtype=bool)
            if dedupe and used.any():
                c = np.maximum(cur, 0)
                same = used & (self._hi.take(c) == hi) & (self._lo.take(c) == lo) & self._alive.take(c)
                if same.any():
                    self._val[cur[same]] = self._val[e[same]]
                    self._alive[e[same]] = False
                    self._live -= int(same.sum())
                    keep &= ~same
            free = np.flatnonzero(~used)
            if len(free):  # entries that reach one empty slot together: the first takes it
                _, first = np.unique(s[free], return_index=True)
                win = free[first]
                self._slot[s[win]] = (e[win] + 1).astype(np.int32)
                keep[win] = False
            step = used & keep  # past another key: the next slot; lost a race: look again
            s = np.where(step, (s + 1) & mask, s)
            e, s, hi, lo = e[keep], s[keep], hi[keep], lo[keep]

    def remove(self, pairs: np.ndarray) -> None:
        """Drop the keys of ``pairs`` that are stored (the others are ignored)."""
        at = self._entries(pairs)
        at = np.unique(at[at >= 0])
        self._alive[at] = False
        self._live -= len(at)

    def _rebuild(self, need: int) -> None:
        """A log and index for ``need`` live keys: the live entries kept, in their order."""
        live = np.flatnonzero(self._alive[: self._n])
        hi, lo, val = self._hi[live], self._lo[live], self._val[live]
        bits = min(self._top, max(_MIN_BITS, (4 * need - 1).bit_length()))
        self._alloc(bits, max(1 << (_MIN_BITS - 2), min(self._max, 2 * need)))
        m = len(live)
        self._hi[:m], self._lo[:m], self._val[:m] = hi, lo, val
        self._alive[:m] = True
        self._n = self._live = m
        self._index(np.arange(m), dedupe=False)
