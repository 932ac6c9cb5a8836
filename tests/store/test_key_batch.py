"""KeyBatch: one validated buffer of n × 16 bytes, the same keys as the per-key API."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import KeyFormatError
from kvstore.keys import KEY_BYTES, BlockKey, KeyBatch, Namespace

NS = Namespace("fp", "bfloat16", 4)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=120))
def test_key_batch_equals_block_keys(tokens):
    batch = NS.key_batch(tokens)
    keys = NS.block_keys(tokens)
    assert len(batch) == len(keys) == len(tokens) // 4
    assert list(batch) == keys
    assert [batch[i] for i in range(len(batch))] == keys
    assert batch.raw == b"".join(k.raw for k in keys)
    assert KeyBatch.of(keys) == batch
    assert batch.raws() == [k.raw for k in keys]


def test_chain_continues_from_a_parent():
    tokens = list(range(40))
    whole = NS.key_batch(tokens)
    tail = NS.key_batch(tokens[16:], start_parent=whole[3])
    assert tail == whole[4:]
    assert len(tail) == 6


def test_validation_is_length_only_and_names_the_size():
    with pytest.raises(KeyFormatError, match="multiple of 16 bytes.*got 17"):
        KeyBatch(b"x" * 17)
    with pytest.raises(KeyFormatError, match="at most 2 keys"):
        KeyBatch(b"x" * 48, max_keys=2)
    with pytest.raises(KeyFormatError, match="bytes, got bytearray"):
        KeyBatch(bytearray(16))
    with pytest.raises(KeyFormatError, match="BlockKeys"):
        KeyBatch.of([b"x" * 16])
    assert len(KeyBatch(b"x" * 32, max_keys=2)) == 2
    assert len(KeyBatch()) == 0


def test_indexing_slicing_and_take():
    batch = NS.key_batch(list(range(40)))  # 10 keys
    keys = list(batch)
    assert batch[-1] == keys[-1]
    with pytest.raises(IndexError, match="10 out of range"):
        batch[10]
    assert list(batch[2:5]) == keys[2:5]
    assert list(batch[::3]) == keys[::3]
    assert list(batch[7:2]) == []
    assert list(batch.take([9, 0, 0, -1])) == [keys[9], keys[0], keys[0], keys[9]]
    assert list(batch.take(np.array([3, 1]))) == [keys[3], keys[1]]
    assert len(batch.take([])) == 0
    with pytest.raises(IndexError, match="12 out of range"):
        batch.take([1, 12])
    assert keys[4] in batch
    assert BlockKey(b"\x00" * 16) not in batch
    assert "nope" not in batch


def test_contains_ignores_a_match_across_two_keys():
    a, b = BlockKey(bytes(range(16))), BlockKey(bytes(range(16, 32)))
    batch = KeyBatch.of([a, b])
    straddle = BlockKey(bytes(range(8, 24)))
    assert straddle not in batch
    assert a in batch and b in batch


def test_immutable_hashable_picklable_and_array_view():
    batch = NS.key_batch(list(range(40)))
    with pytest.raises(AttributeError):
        batch._raw = b""  # type: ignore[misc]
    assert hash(batch) == hash(KeyBatch(batch.raw))
    assert {batch: 1}[KeyBatch(batch.raw)] == 1
    assert pickle.loads(pickle.dumps(batch)) == batch
    arr = batch.array()
    assert arr.shape == (10, KEY_BYTES)
    assert not arr.flags.writeable
    assert arr[2].tobytes() == batch[2].raw
    assert batch + batch[:1] == KeyBatch(batch.raw + batch[0].raw)
    assert batch != list(batch)
