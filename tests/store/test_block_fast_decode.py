"""The block header's fast decode (kvstore/block.py ``_well_formed``, what a client runs per
block received) accepts exactly what the field-by-field decode accepts, and gives the same
header: a lying or sloppy peer's header (one field of another type, a bool for an int, a
15-byte key, a shape that does not make ``len``, a checksum past u64, extra dims, a
missing field) is refused by both, or decoded by both to equal headers."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.block import BlockHeader, _well_formed, make_header
from kvstore.errors import BlockFormatError
from kvstore.keys import Namespace

NS = Namespace("fp-fast", "bfloat16", 4)
HDR = make_header(
    key=NS.block_keys([1, 2, 3, 4])[0],
    parent=NS.id,
    namespace=NS.id,
    tokens=[1, 2, 3, 4],
    dtype="bfloat16",
    shape=[2, 2, 4, 2, 8],
    payload=bytes(512),
)
WIRE = msgpack.unpackb(HDR.encode())

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=24),
    st.lists(st.one_of(st.integers(-2, 600), st.booleans(), st.floats(0, 3)), max_size=6),
)


def _both(wire: dict) -> tuple[BlockHeader | None, BlockHeader | str]:
    fast = _well_formed(wire)
    try:
        checked: BlockHeader | str = BlockHeader._checked(wire)
    except BlockFormatError as exc:
        checked = str(exc)
    return fast, checked


def test_a_header_as_encoded_takes_the_fast_path_and_equals_the_checked_one():
    fast, checked = _both(dict(WIRE))
    assert fast is not None and fast == checked == HDR
    assert BlockHeader.decode(HDR.encode()) == HDR
    assert fast.key.raw == HDR.key.raw and fast.shape == (2, 2, 4, 2, 8) and type(fast.created) is float


@given(st.sampled_from(sorted(WIRE)), VALUES)
@example("created", 7)  # an int for a float: both take it, as a float
@example("shape", [2, 2, 4, 2, True])  # a bool among the dims
@example("shape", [512])  # another shape of the same size: a valid header
@example("key", bytes(15))
@example("xxh3", 2**64 - 1)
def test_one_field_changed_fast_and_checked_agree(field, value):
    fast, checked = _both(dict(WIRE, **{field: value}))
    if isinstance(checked, str):
        assert fast is None, (field, value, checked)
    elif fast is not None:
        assert fast == checked
        assert type(fast.created) is float and all(type(d) is int for d in fast.shape)


@pytest.mark.parametrize("field", sorted(WIRE))
def test_a_missing_field_is_refused_by_decode(field):
    wire = dict(WIRE)
    del wire[field]
    assert _well_formed(wire) is None
    with pytest.raises(BlockFormatError):
        BlockHeader.decode(msgpack.packb(wire, use_bin_type=True))
