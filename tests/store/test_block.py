"""Block format: header codec round trip, malformed input rejected, checksum catches flips, and
the one check every reader makes of a block it receives (``check_block``)."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.block import BlockHeader, Expect, check_block, checksum, make_header
from kvstore.errors import BlockFormatError
from kvstore.keys import Namespace
from kvstore.results import Status

NS = Namespace("fp", "float16", 4)


def _header(payload: bytes, tokens=(1, 2, 3, 4)) -> BlockHeader:
    key = NS.block_keys(list(tokens))[0]
    return make_header(
        key=key,
        parent=NS.id,
        namespace=NS.id,
        tokens=list(tokens),
        dtype="float16",
        shape=[len(payload) // 2],
        payload=payload,
    )


@given(
    st.binary(min_size=2, max_size=4096).filter(lambda b: len(b) % 2 == 0),
    st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=4),
)
def test_roundtrip(payload, tokens):
    h = _header(payload, tokens)
    h2 = BlockHeader.decode(h.encode())
    assert h2 == h
    assert h2.tokens == tokens
    assert check_block(h2, h.key, Expect(NS.id, h.token_bytes), checksum(payload)) is Status.HIT


def test_checksum_catches_any_single_flip():
    payload = bytes(range(256)) * 16
    h = _header(payload)
    for i in range(0, len(payload), 97):
        bad = bytearray(payload)
        bad[i] ^= 0x01
        assert check_block(h, h.key, None, checksum(bad)) is Status.CORRUPT
    assert check_block(h, h.key, None, checksum(payload[:-2])) is Status.CORRUPT


def test_check_block_judges_key_parent_tokens_then_checksum():
    payload = b"\x00" * 64
    h = _header(payload)
    good = checksum(payload)
    assert check_block(h, h.key, Expect(NS.id, h.token_bytes), good) is Status.HIT
    assert check_block(h, h.key) is Status.HIT  # no expectation, no digest: the key alone
    assert check_block(h, h.key, Expect(h.key, None), good) is Status.MISMATCH, "wrong parent"
    assert check_block(h, h.key, Expect(None, b"\x00" * 16), good) is Status.MISMATCH, "wrong tokens"
    assert check_block(h, NS.id, None, good) is Status.MISMATCH, "another key"
    # another block is MISMATCH whatever its bytes: identity is judged before the checksum
    assert check_block(h, NS.id, None, good ^ 1) is Status.MISMATCH
    assert check_block(h, h.key, Expect(NS.id, None), good ^ 1) is Status.CORRUPT


# a value of every msgpack type, for any field of a valid header's wire form
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # msgpack's integers
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=24),
    st.lists(st.integers(-2, 64), max_size=3),
)


def _assert_carries_the_wire_values(h: BlockHeader, wire: dict) -> None:
    """A header that decoded is exactly what the wire said: each field encodes back to the
    wire's value, of the type encode() writes (``created``, a number, may arrive as an int)."""
    back = msgpack.unpackb(h.encode())
    assert set(back) <= set(wire)
    for field, value in back.items():
        sent = float(wire[field]) if field == "created" else wire[field]
        nan = isinstance(sent, float) and math.isnan(sent) and math.isnan(value)
        assert value == sent or nan, (field, sent, value)
        assert type(value) is type(sent), (field, sent)


@given(st.binary(max_size=300))
def test_garbage_never_decodes_silently(data):
    try:
        h = BlockHeader.decode(data)
    except BlockFormatError:
        return
    _assert_carries_the_wire_values(h, msgpack.unpackb(data))


WIRE = msgpack.unpackb(_header(b"\x00" * 64).encode())


@given(st.sampled_from(sorted(WIRE)), ANY_VALUE)
@example("xxh3", 12345)  # fields a header may carry other values in: the decoding branch runs
@example("created", 7)
def test_a_header_with_one_field_changed_decodes_as_sent_or_not_at_all(field, value):
    """No coercion: a bool, a float or digits in a string for an integer field, an infinite
    length or version, a mapping for the shape are each a BlockFormatError, never a header
    holding something else than what was sent, nor another exception."""
    wire = dict(WIRE, **{field: value})
    try:
        h = BlockHeader.decode(msgpack.packb(wire, use_bin_type=True))
    except BlockFormatError:
        return
    _assert_carries_the_wire_values(h, wire)


def test_inconsistent_fields_rejected():
    h = _header(b"\x00" * 64)
    d = msgpack.unpackb(h.encode())
    for field, value, word in [
        ("len", 63, "payload_len"),
        ("dtype", "complex128", "dtype"),
        ("v", 99, "version"),
        ("key", b"abc", "16 bytes"),
        ("shape", [-1], "shape"),
        ("tokens", b"abc", "token bytes"),
    ]:
        bad = dict(d, **{field: value})
        with pytest.raises(BlockFormatError):
            BlockHeader.decode(msgpack.packb(bad))
        del word
    missing = dict(d)
    del missing["xxh3"]
    with pytest.raises(BlockFormatError, match="missing"):
        BlockHeader.decode(msgpack.packb(missing))
