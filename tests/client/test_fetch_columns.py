"""A GET reply's columns (protocol 4: ``st``, ``tier``, ``hdrs`` with ``hend``) as
``GetReply.from_wire`` reads them: exactly what docs/protocol.md (GET) accepts is accepted,
each header decoded once and equal to ``BlockHeader.decode`` of its bytes -- the usual reply,
mixed ones (several token counts, small checksums, headers encoded another way) -- and every
lie the document names is refused, naming the bad column or header. And a read's results are
one object that reads as the list of per-key records (``GetResults``)."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.block import BlockHeader, make_header
from kvstore.keys import Namespace
from kvstore.lookups import tier_names
from kvstore.results import GetResult, GetResults, Status

NS = Namespace("columns", "uint8", 4)
KEYS = NS.block_keys(list(range(4 * 8)))


def _hdr(k: int, tokens: int = 4, size: int = 64, xxh: int | None = None, created: float = 1.5):
    h = make_header(
        key=KEYS[k],
        parent=KEYS[k - 1] if k else NS.id,
        namespace=NS.id,
        tokens=list(range(k, k + tokens)),
        dtype="uint8",
        shape=[size],
        payload=bytes([k]) * size,
        created=created,
    )
    if xxh is not None:
        object.__setattr__(h, "checksum", xxh)
    return h


def _raw_variant(k: int, kind: str) -> bytes:
    """Header ``k`` encoded: as encode() writes it, or in a way the layout does not take."""
    if kind == "usual":
        return _hdr(k).encode()
    if kind == "tokens8":
        return _hdr(k, tokens=8).encode()
    if kind == "small_xxh3":
        return _hdr(k, xxh=7).encode()
    if kind == "size32":
        return _hdr(k, size=32).encode()
    d = msgpack.unpackb(_hdr(k).encode(), raw=False)
    if kind == "reordered":
        return msgpack.packb(dict(reversed(list(d.items()))), use_bin_type=True)
    if kind == "int_created":
        return msgpack.packb({**d, "created": 3}, use_bin_type=True)
    if kind == "bad_shape":
        return msgpack.packb({**d, "shape": [65]}, use_bin_type=True)
    if kind == "bad_key":
        return msgpack.packb({**d, "key": b"short"}, use_bin_type=True)
    if kind == "garbage":
        return b"\xc1" + _hdr(k).encode()[1:]
    if kind == "truncated":
        return _hdr(k).encode()[:-2]
    raise AssertionError(kind)


KINDS = ["usual"] * 6 + [
    "tokens8",
    "small_xxh3",
    "size32",
    "reordered",
    "int_created",
    "bad_shape",
    "bad_key",
    "garbage",
    "truncated",
]
ENTRY = st.tuples(
    st.sampled_from([0, 0, 0, 1, 2, 3, 4, 11, 99]),
    st.one_of(st.sampled_from(KINDS), st.none()),
    st.sampled_from([2, 3, 0, 0, 1, 7]),
)
DECODES = {"usual", "tokens8", "small_xxh3", "size32", "reordered", "int_created"}
SPANS = st.sampled_from(["right", "right", "right", "shrinks", "past_end", "bytes_after", "short"])


def _reply(entries, plen_delta: int = 0, spans: str = "right") -> dict:
    """The columns of ``entries`` ``(status, header kind or None, tier code)``, as the client
    receives them; ``spans`` lies about where the headers end."""
    raws = [b"" if kind is None else _raw_variant(j, kind) for j, (_, kind, _) in enumerate(entries)]
    ends, at = [], 0
    for r in raws:
        at += len(r)
        ends.append(at)
    hdrs = b"".join(raws)
    if spans == "shrinks" and len(ends) > 1 and ends[0]:
        ends[1] = ends[0] - 1
    elif spans == "past_end" and ends:
        ends[-1] += 1
    elif spans == "bytes_after":
        hdrs += b"\x00"
    hend = struct.pack(f"<{len(ends)}I", *ends)
    if spans == "short" and entries:
        hend = hend[:-1]
    plen = sum(_hdr_len(kind) for code, kind, _ in entries if code == 0 and kind in DECODES)
    wire = {
        "rid": 5,
        "ok": True,
        "st": bytes(c for c, _, _ in entries),
        "tier": bytes(t for *_, t in entries),
        "hdrs": hdrs,
        "hend": hend,
        "plen": plen + plen_delta,
    }
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)


def _hdr_len(kind: str) -> int:
    return 32 if kind == "size32" else 64


def _documented(entries, plen_delta: int, spans: str) -> bool:
    """Whether docs/protocol.md (GET) accepts the reply ``_reply`` makes of these."""
    spans_ok = (
        spans == "right"
        or (spans == "shrinks" and not (len(entries) > 1 and entries[0][1] is not None))
        or (spans in ("past_end", "short") and not entries)
    )
    return (
        spans_ok
        and plen_delta == 0
        and all(
            code in (0, 1, 4)
            and tier <= 3
            and (kind is None or kind in DECODES)
            and ((kind is None) == (code == 1) == (tier == 0))
            for code, kind, tier in entries
        )
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(ENTRY, max_size=8), st.sampled_from([0, 0, 0, 64, -32]), SPANS)
@example([(0, "usual", 2)] * 8, 0, "right")
@example([(0, "usual", 2), (0, "tokens8", 2), (1, None, 0), (0, "small_xxh3", 3)], 0, "right")
@example([(0, "usual", 2), (0, "reordered", 3), (4, "int_created", 2)], 0, "right")
@example([(0, "usual", 2), (0, "bad_shape", 2)], 0, "right")
@example([(0, "usual", 2), (0, None, 2)], 0, "right")  # a HIT without a header
@example([(1, "usual", 0)], 0, "right")  # a MISS with a header
@example([(3, "usual", 2)], 0, "right")  # MISMATCH: the client's to say, never the node's
def test_the_columns_take_exactly_what_the_document_takes(entries, plen_delta, spans):
    h = _reply(entries, plen_delta, spans)
    n = len(entries)
    try:
        got = P.GetReply.from_wire(h, n)
    except P.ProtocolError as exc:
        assert exc.code == P.BAD_REQUEST
        assert not _documented(entries, plen_delta, spans), exc
        bad = [j for j, (_, kind, _) in enumerate(entries) if kind is not None and kind not in DECODES]
        if bad and spans == "right" and "hdrs[" in str(exc):
            assert f"hdrs[{bad[0]}]" in str(exc)  # the first bad header, named
        return
    assert _documented(entries, plen_delta, spans), entries
    assert got.rid == 5 and got.plen == h["plen"]
    assert list(got.codes) == [c for c, _, _ in entries] and list(got.tiers) == [t for *_, t in entries]
    assert got.hits() == [j for j, (c, _, _) in enumerate(entries) if c == 0]
    for j, (_, kind, _) in enumerate(entries):
        assert got.blocks[j] == (None if kind is None else BlockHeader.decode(_raw_variant(j, kind)))


def test_the_node_side_builder_writes_what_the_reader_reads():
    """``GetReply.of`` (the daemon's) gives the columns ``from_wire`` (the client's) reads."""
    raws = [_hdr(0).encode(), _hdr(3, tokens=8).encode()]
    sent = P.GetReply.of(9, 5, [1, 3], bytes([0, 4]), raws, bytes([2, 3]))
    wire = msgpack.unpackb(msgpack.packb({**sent.to_wire(), "plen": 64}, use_bin_type=True), raw=False)
    got = P.GetReply.from_wire(wire, 5)
    assert list(got.codes) == [1, 0, 1, 4, 1] and list(got.tiers) == [0, 2, 0, 3, 0]
    assert got.blocks == (None, _hdr(0), None, _hdr(3, tokens=8), None) and got.hits() == [1]
    empty = P.GetReply.of(1, 3, [], b"", [], b"")
    assert P.GetReply.from_wire({**empty.to_wire(), "plen": 0}, 3).codes == bytes([1, 1, 1])


def test_results_are_one_object_that_reads_as_the_list_of_records():
    h = _reply([(0, "usual", 2), (1, None, 0), (0, "usual", 3)])
    got = P.GetReply.from_wire(h, 3)
    part = GetResults(b"\x00\x01\x02", tier_names(got.tiers), got.blocks.__getitem__, 64)
    as_list = [
        GetResult(Status.HIT, _hdr(0), "dram"),
        GetResult(Status.MISS, None, None),
        GetResult(Status.CORRUPT, _hdr(2), "disk"),
    ]
    assert part == as_list and as_list == part and list(part) == as_list
    assert part[-1] == as_list[-1] and part[1:] == as_list[1:]
    with pytest.raises(IndexError):
        part[3]
    joined = GetResults.join([part, GetResults.failed(Status.TIMEOUT, 2), GetResults.of(as_list)])
    assert len(joined) == 8 and joined.hit_bytes == 64 + 64
    assert list(joined) == as_list + [GetResult(Status.TIMEOUT)] * 2 + as_list
    assert joined.count_of(Status.HIT) == 2 and joined.count_of(Status.TIMEOUT) == 2
    [a, b, c] = part
    assert (a.status, b.status, c.status) == (Status.HIT, Status.MISS, Status.CORRUPT)
    assert np.frombuffer(joined.codes, np.uint8).tolist() == [0, 1, 2, 11, 11, 0, 1, 2]
