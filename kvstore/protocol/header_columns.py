"""A batch of encoded block headers, checked and split into columns in bulk (a client receives
2,048 of them in one GET reply of 256 KiB blocks).

Most headers of one batch share a layout: :meth:`BlockHeader.encode` writes the map's fields
in one order with the smallest encoding of each value, so headers of one model differ only in
the bytes of the values of ``key``, ``parent``, ``ns``, ``tokens`` (of one length), ``xxh3``
(a u64) and ``created`` (a float64). :meth:`HeaderColumns.of` decodes one header (the
template) the checked way and requires its re-encoding to be the same bytes; every header of
the template's length whose bytes outside those value spans equal the template's is then a
header of the same version, dtype, shape and payload length, with 16-byte keys, tokens of the
template's length, a u64 checksum and a float ``created`` — values ``decode`` accepts whatever
they are — so it is well formed without a decode of its own, and numpy reads its columns. A
header that does not fit (another length, another byte where the template has a fixed one,
not bytes) is decoded alone by the caller's ``decode_one``, which names what is wrong.
``block(i)`` decodes header ``i`` when someone asks for it (cached): the same BlockHeader
the per-header decode gives (tests/client/test_fetch_columns.py checks both ways agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgpack
import numpy as np

from kvstore.block import BlockHeader
from kvstore.keys import KEY_BYTES

# the header map's field names (block-format fields, not wire fields: tests/daemon/test_wire_types.py)
_KEY, _PARENT, _TOKENS, _XXH3 = "key", "parent", "tokens", "xxh3"
_BIN_FIELDS = (_KEY, _PARENT, "ns", _TOKENS)
# a u64 checksum (uint 64) and a float64 ``created``: encodings where any 8 value bytes decode
_FIXED_WIDTH = {(_XXH3, 0xCF), ("created", 0xCB)}
_MAX_LAYOUTS = 4  # template layouts tried per batch; the rest is decoded header by header


class _Layout:
    """Where the values of a template's variable fields lie (``spans``: name -> (start, len))."""

    def __init__(self, raw: bytes, spans: dict[str, tuple[int, int]]) -> None:
        self.raw = raw
        self.spans = spans
        fixed = np.ones(len(raw), bool)
        for start, n in spans.values():
            fixed[start : start + n] = False
        self.fixed = fixed
        self.fixed_bytes = np.frombuffer(raw, np.uint8)[fixed]


def _layout(h: BlockHeader, raw: bytes) -> _Layout | None:
    """The layout of ``raw``, the encoding of ``h``; None unless ``raw`` is exactly what
    :meth:`BlockHeader.encode` writes for ``h`` (else no offset can be trusted)."""
    fields = h.wire_map()
    out = bytearray(msgpack.packb(fields, use_bin_type=True)[:1])  # the map's own header
    spans: dict[str, tuple[int, int]] = {}
    for name, value in fields.items():
        out += msgpack.packb(name)
        enc = msgpack.packb(value, use_bin_type=True)
        if name in _BIN_FIELDS:
            spans[name] = (len(out) + len(enc) - len(value), len(value))
        elif (name, enc[0]) in _FIXED_WIDTH:  # every 8 bytes are a valid value
            spans[name] = (len(out) + 1, 8)
        out += enc
    return _Layout(raw, spans) if bytes(out) == raw else None


class HeaderColumns:
    """Per entry of a batch (None where it has no header): ``keys`` and ``parents`` (n × 16
    uint8, zeros without a header), ``checksums`` (uint64), ``payload_lens`` (int64, 0 without
    a header), and the header itself on demand (:meth:`block`)."""

    def __init__(self, raws: Sequence[bytes | None]) -> None:
        n = len(raws)
        self.raws = raws
        self.keys = np.zeros((n, KEY_BYTES), np.uint8)
        self.parents = np.zeros((n, KEY_BYTES), np.uint8)
        self.checksums = np.zeros(n, np.uint64)
        self.payload_lens = np.zeros(n, np.int64)
        # token ids of entries read through a layout: (rows, array of their token bytes)
        self._tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self._blocks: dict[int, BlockHeader] = {}

    @classmethod
    def of(
        cls, raws: Sequence[bytes | None], decode_one: Callable[[int, object], BlockHeader]
    ) -> HeaderColumns:
        """The columns of ``raws``; ``decode_one(i, raw)`` decodes a header that fits no layout
        (raising the caller's error, which names entry ``i``)."""
        cols = cls(raws)
        present = [i for i, r in enumerate(raws) if r is not None] if None in raws else range(len(raws))
        left = np.array(present, np.intp)
        for _ in range(_MAX_LAYOUTS):
            if not len(left):
                return cols
            first = int(left[0])
            raw = raws[first]
            if type(raw) is not bytes:
                break
            h = cols._blocks[first] = decode_one(first, raw)
            lay = _layout(h, raw)
            if lay is None:
                break
            left = cols._read_layout(lay, h, left)
        for i in left.tolist():
            cols.put(i, decode_one(i, raws[i]))
        return cols

    def _read_layout(self, lay: _Layout, h: BlockHeader, left: np.ndarray) -> np.ndarray:
        """Fill the columns of the entries of ``left`` that fit ``lay`` (its template ``h``
        among them); the entries that do not, for the next template."""
        raws, size = self.raws, len(lay.raw)
        same = np.fromiter(
            (type(raws[i]) is bytes and len(raws[i]) == size for i in left.tolist()), bool, len(left)
        )
        rows = left[same]
        arr = np.frombuffer(b"".join([raws[i] for i in rows.tolist()]), np.uint8).reshape(len(rows), size)
        fits = (arr[:, lay.fixed] == lay.fixed_bytes).all(axis=1)
        rows, arr = rows[fits], arr[fits]
        sp = lay.spans
        for name, col in ((_KEY, self.keys), (_PARENT, self.parents)):
            start, n = sp[name]
            col[rows] = arr[:, start : start + n]
        if _XXH3 in sp:
            start, _ = sp[_XXH3]
            self.checksums[rows] = np.ascontiguousarray(arr[:, start : start + 8]).view(">u8").ravel()
        else:  # a fixed byte of the layout: every row has the template's
            self.checksums[rows] = h.checksum
        self.payload_lens[rows] = h.payload_len
        start, n = sp[_TOKENS]
        self._tokens.append((rows, arr[:, start : start + n]))
        out = np.ones(len(left), bool)
        out[np.flatnonzero(same)[fits]] = False
        return left[out]

    def put(self, i: int, h: BlockHeader) -> None:
        """Entry ``i``'s columns from its decoded header ``h``."""
        self._blocks[i] = h
        self.keys[i] = np.frombuffer(h.key.raw, np.uint8)
        self.parents[i] = np.frombuffer(h.parent.raw, np.uint8)
        self.checksums[i] = h.checksum
        self.payload_lens[i] = h.payload_len

    def block(self, i: int) -> BlockHeader | None:
        """Entry ``i``'s header, decoded once when first asked for; None without one."""
        h = self._blocks.get(i)
        if h is None and self.raws[i] is not None:
            h = self._blocks[i] = BlockHeader.decode(self.raws[i])
        return h

    def tokens_equal(self, rows: np.ndarray, want: Sequence[bytes]) -> np.ndarray:
        """Per entry of ``rows`` (each with a header): whether its token bytes are ``want[k]``."""
        out = np.zeros(len(rows), bool)
        done = np.zeros(len(rows), bool)
        for lay_rows, toks in self._tokens:
            k = np.flatnonzero(np.isin(rows, lay_rows))
            if not len(k):
                continue
            wk = [want[j] for j in k.tolist()]
            width = toks.shape[1]
            if all(len(w) == width for w in wk):  # else each is compared alone, below
                got = toks[np.searchsorted(lay_rows, rows[k])]
                out[k] = (got == np.frombuffer(b"".join(wk), np.uint8).reshape(len(k), width)).all(axis=1)
                done[k] = True
        for j in np.flatnonzero(~done).tolist():
            out[j] = self.block(int(rows[j])).token_bytes == want[j]
        return out
