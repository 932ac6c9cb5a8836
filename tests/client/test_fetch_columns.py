"""A GET reply received as columns (kvstore/protocol/records.py ``GetColumns``, with
kvstore/protocol/header_columns.py's bulk header check) and its payloads checked all at once
(kvstore/client/conn.py ``check_payloads``) give exactly what the per-entry decode
(``GetReply.from_wire``) and the per-block check (``check_payload``) give: the same refusals
with the same messages, the same headers, the same statuses — for the usual reply (one
layout), mixed ones (several token counts, small checksums, headers encoded another way) and
lying ones."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.block import make_header
from kvstore.client.conn import check_payload, check_payloads
from kvstore.keys import BlockKey, Namespace
from kvstore.protocol.records import GetColumns
from kvstore.results import Expect, GetResult, GetResults, Status

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
    st.sampled_from([0, 0, 0, 1, 2, 3, 4, 11, 99, -1, True, "0", None]),
    st.one_of(st.sampled_from(KINDS), st.none(), st.just(7)),
    st.sampled_from(["dram", "disk", None, None, 3, b"x"]),
)


def _reply(entries, k0: int = 0, plen_delta: int = 0):
    res, plen = [], 0
    for j, (code, kind, tier) in enumerate(entries):
        raw = kind if not isinstance(kind, str) else _raw_variant(k0 + j, kind)
        res.append([code, raw, tier])
        if code == 0 and isinstance(kind, str) and kind in ("usual", "tokens8", "small_xxh3", "reordered"):
            plen += 64
        elif code == 0 and kind == "size32":
            plen += 32
        elif code == 0 and kind == "int_created":
            plen += 64
    wire = msgpack.packb({"rid": 5, "ok": True, "res": res, "plen": plen + plen_delta}, use_bin_type=True)
    return msgpack.unpackb(wire, raw=False)  # as the client receives it


def _outcome(fn):
    try:
        return fn()
    except P.ProtocolError as exc:
        return ("refused", exc.code, str(exc))


@settings(max_examples=400, deadline=None)
@given(st.lists(ENTRY, max_size=8), st.sampled_from([0, 0, 0, 64, -32]))
@example([(0, "usual", "dram")] * 8, 0)
@example([(0, "usual", "dram"), (0, "tokens8", "dram"), (1, None, None), (0, "small_xxh3", None)], 0)
@example([(0, "usual", "dram"), (0, "reordered", "disk"), (0, "int_created", None)], 0)
@example([(0, "usual", "dram"), (0, "bad_shape", "dram")], 0)
@example([(0, "usual", "dram"), (0, None, "dram")], 0)  # a HIT without a header
@example([(True, "usual", "dram")], 0)  # a bool status: as the per-entry decode takes it
def test_columns_equal_the_per_entry_decode(entries, plen_delta):
    h = _reply(entries, plen_delta=plen_delta)
    n = len(entries)
    slow = _outcome(lambda: P.GetReply.from_wire(h, n))
    fast = _outcome(lambda: GetColumns(h, n))
    if isinstance(slow, tuple):
        assert fast == slow
        return
    assert not isinstance(fast, tuple), fast
    assert fast.rid == slow.rid and fast.plen == slow.plen
    assert list(fast.codes) == [int(e.status) for e in slow.entries]
    assert list(fast.tiers) == [e.tier for e in slow.entries]
    cols = fast.headers
    for i, e in enumerate(slow.entries):
        assert cols.block(i) == e.block
        if e.block is None:
            continue
        assert bytes(cols.keys[i]) == e.block.key.raw and bytes(cols.parents[i]) == e.block.parent.raw
        assert int(cols.checksums[i]) == e.block.checksum and int(cols.payload_lens[i]) == e.block.payload_len


def test_a_reply_of_one_layout_needs_no_header_decode():
    """The bulk path is taken for the usual reply: no header is decoded until asked for."""
    h = _reply([(0, "usual", "dram")] * 8)
    cols = GetColumns(h, 8)
    assert len(cols.headers._blocks) == 1  # the template only
    assert cols.headers.block(5) == _hdr(5)
    assert len(cols.headers._blocks) == 2


EXPECTS = st.sampled_from(["none", "right", "wrong_parent", "wrong_tokens", "short_tokens", "parent_only"])


def _expect(k: int, kind: str, tokens: int) -> Expect | None:
    h = _hdr(k, tokens=tokens)
    return {
        "none": None,
        "right": Expect(h.parent, h.token_bytes),
        "wrong_parent": Expect(KEYS[(k + 3) % len(KEYS)], h.token_bytes),
        "wrong_tokens": Expect(h.parent, bytes(len(h.token_bytes))),
        "short_tokens": Expect(None, h.token_bytes[:4]),
        "parent_only": Expect(h.parent, None),
    }[kind]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 0, 0, 1]),
            st.sampled_from(["usual", "usual", "tokens8", "reordered"]),
            st.booleans(),  # the key asked for is the block's
            st.booleans(),  # the digest is the block's
            EXPECTS,
        ),
        max_size=8,
    )
)
def test_the_bulk_check_equals_the_per_block_check(blocks):
    h = _reply([(code, kind, "dram") for code, kind, *_ in blocks])
    cols = GetColumns(h, len(blocks))
    slow = P.GetReply.from_wire(h, len(blocks))
    keys, expect, digests, want = [], [], [], []
    for j, ((code, kind, own_key, good_sum, exp_kind), e) in enumerate(zip(blocks, slow.entries)):
        key = KEYS[j] if own_key else BlockKey(bytes([j]) * 16)
        exp = _expect(j, exp_kind, 8 if kind == "tokens8" else 4)
        keys.append(key)
        expect.append(exp)
        if code == 0:
            d = e.block.checksum if good_sum else e.block.checksum ^ 1
            digests.append(d)
            want.append(int(check_payload(e.block, key, exp, memoryview(b""), d)))
        else:
            want.append(code)
    assert list(check_payloads(cols, keys, expect, digests)) == want


def test_results_are_one_object_that_reads_as_the_list_of_records():
    h = _reply([(0, "usual", "dram"), (1, None, None), (0, "usual", "disk")])
    cols = GetColumns(h, 3)
    part = GetResults(b"\x00\x01\x02", cols.tiers, cols.headers.block, 64)
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
