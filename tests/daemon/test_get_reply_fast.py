"""A GET reply's entries decoded in one pass (kvstore/protocol/records.py
``get_entries_from_wire``, what a client runs per block received) are exactly what the
per-entry decode gives, and a lying node's entry (a status code out of range or of another
type, a HIT without a header, a header that is garbage or not bytes, a tier that is not a
string) is refused the same way, with the same message naming it."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.block import make_header
from kvstore.keys import Namespace
from kvstore.protocol.records import GetEntry, get_entries_from_wire
from kvstore.results import Status

NS = Namespace("fast-reply", "uint8", 4)
HDR = make_header(
    key=NS.block_keys([1, 2, 3, 4])[0],
    parent=NS.id,
    namespace=NS.id,
    tokens=[1, 2, 3, 4],
    dtype="uint8",
    shape=[64],
    payload=bytes(64),
)
RAW = HDR.encode()

CODES = st.one_of(st.integers(-2, 14), st.booleans(), st.none(), st.text(max_size=3), st.floats(0, 2))
HEADERS = st.one_of(st.none(), st.just(RAW), st.binary(max_size=40), st.integers(0, 3), st.just(RAW[:-1]))
TIERS = st.one_of(
    st.none(), st.sampled_from(["dram", "disk", "hbm", ""]), st.integers(0, 3), st.binary(max_size=3)
)


def _outcome(fn, items):
    try:
        return fn(items)
    except P.ProtocolError as exc:
        return (exc.code, str(exc))


def _slow(items):
    return tuple(GetEntry.from_wire(x, f"res[{i}]") for i, x in enumerate(items))


@given(st.lists(st.tuples(CODES, HEADERS, TIERS).map(list), max_size=6))
@example([[0, RAW, "dram"], [1, None, None], [4, RAW, "dram"]])
@example([[0, None, "dram"]])  # a HIT without a header
@example([[True, None, None]])  # a bool for a status: as the per-entry decode takes it
@example([[0, RAW, 2]])  # a tier that is not a string
def test_one_pass_equals_the_per_entry_decode(items):
    fast, slow = _outcome(lambda x: get_entries_from_wire(x, "res"), items), _outcome(_slow, items)
    assert fast == slow
    if isinstance(slow, tuple) and slow and isinstance(slow[0], GetEntry):
        assert [e.block for e in fast] == [e.block for e in slow]
        assert all(e.status is s.status for e, s in zip(fast, slow, strict=True))


def test_a_get_reply_decodes_as_before_and_refuses_a_lying_one():
    reply = {"rid": 3, "ok": True, "res": [[0, RAW, "dram"], [1, None, None]], "plen": 64}
    got = P.GetReply.from_wire(msgpack.unpackb(msgpack.packb(reply, use_bin_type=True)), 2)
    assert [e.status for e in got.entries] == [Status.HIT, Status.MISS]
    assert got.entries[0].block == HDR and got.entries[0].tier == "dram" and got.plen == 64
    for bad, says in (
        ([[0, None, "dram"], [1, None, None]], "res\\[0\\]: HIT without a header"),
        ([[0, RAW[:-3], "dram"], [1, None, None]], "res\\[0\\] header"),
        ([[0, RAW, "dram"], [99, None, None]], "res\\[1\\] status"),
    ):
        with pytest.raises(P.ProtocolError, match=says):
            P.GetReply.from_wire({**reply, "res": bad}, 2)
    with pytest.raises(P.ProtocolError, match="payload length"):
        P.GetReply.from_wire({**reply, "plen": 65}, 2)
