"""The lookup's key table (kvstore/keytable.py): the same answers as a dict under a
random mix of batch inserts, removals and finds (keys repeated within a batch, asked in
other orders than inserted, runs broken by other inserts), bounded, growing, rebuilt."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.keys import KeyBatch
from kvstore.keytable import KeyTable, key_pairs


def _pairs(raws: list[bytes]) -> np.ndarray:
    return key_pairs(KeyBatch(b"".join(raws)))


@pytest.mark.parametrize("seed", range(4))
def test_key_table_answers_as_a_dict(seed):
    rnd = random.Random(seed)
    t, ref = KeyTable(3000), {}
    pool = [rnd.randbytes(16) for _ in range(5000)]
    # keys that differ from another in one half only: both halves are compared
    pool += [pool[0][:8] + rnd.randbytes(8), rnd.randbytes(8) + pool[1][8:]]
    for step in range(250):
        op = rnd.choice("iiifr")
        if rnd.random() < 0.5:  # a run of the pool, as a prompt's keys
            lo = rnd.randrange(len(pool))
            ks = pool[lo : lo + rnd.randint(0, 700)]
        else:
            ks = [rnd.choice(pool) for _ in range(rnd.randint(0, 300))]
        if op == "i":
            if len(ref) + len(ks) > 3000:
                t.clear()
                ref.clear()
            vals = [rnd.randrange(1 << 31) for _ in ks]
            t.insert(_pairs(ks), np.array(vals, dtype=np.int64))
            for k in set(ks):  # a key repeated in one insert takes one of its values
                ref[k] = {v for kk, v in zip(ks, vals) if kk == k}
        elif op == "r":
            t.remove(_pairs(ks))
            for k in ks:
                ref.pop(k, None)
        asked = pool if step % 25 == 0 else ks + [rnd.choice(pool) for _ in range(50)]
        got = t.find(_pairs(asked)).tolist()
        assert len(got) == len(asked)
        for k, g in zip(asked, got):
            assert (g in ref[k]) if k in ref else g == -1, (step, op)
        assert len(t) == len(ref)
    assert 0 < len(ref) <= 3000


def test_key_table_order_of_asking_does_not_matter():
    rnd = random.Random(9)
    ks = [rnd.randbytes(16) for _ in range(3000)]
    t = KeyTable(10000)
    t.insert(_pairs(ks[:1000]), np.arange(1000))
    t.insert(_pairs([rnd.randbytes(16) for _ in range(500)]), np.zeros(500))  # breaks the run
    t.insert(_pairs(ks[1000:]), np.arange(1000, 3000))
    for order in (list(range(3000)), list(range(2999, -1, -1)), rnd.sample(range(3000), 3000)):
        got = t.find(_pairs([ks[i] for i in order]))
        assert got.tolist() == order
    assert t.find(_pairs([])).tolist() == []


def test_key_table_is_bounded_and_refuses_past_it():
    t = KeyTable(100)
    ks = [bytes([i]) * 16 for i in range(101)]
    t.insert(_pairs(ks[:100]), np.arange(100))
    t.insert(_pairs(ks[:50]), np.arange(50) + 7)  # known keys: values change, no new entries
    assert len(t) == 100 and t.find(_pairs(ks[:2])).tolist() == [7, 8]
    with pytest.raises(ValueError, match="over max_entries 100"):
        t.insert(_pairs(ks[100:]), np.zeros(1))
    with pytest.raises(ValueError, match="values in"):
        t.insert(_pairs(ks[:1]), np.array([1 << 31]))
    t.remove(_pairs(ks[:10]))
    t.insert(_pairs(ks[100:]), np.array([5]))
    assert len(t) == 91 and t.find(_pairs(ks[99:])).tolist() == [99, 5]
    t.clear()
    assert len(t) == 0 and t.find(_pairs(ks)).tolist() == [-1] * 101
    with pytest.raises(ValueError, match="max_entries"):
        KeyTable(0)


def test_key_table_survives_many_removals_and_growth():
    """Removal markers pile up and the table grows from its smallest size: rebuilt each
    time, nothing lost, nothing found that was removed."""
    rnd = random.Random(11)
    t = KeyTable(1 << 15)
    live: dict[bytes, int] = {}
    for rnd_i in range(40):
        ks = [rnd.randbytes(16) for _ in range(600)]
        t.insert(_pairs(ks), np.full(600, rnd_i))
        live.update(dict.fromkeys(ks, rnd_i))
        gone = rnd.sample(sorted(live), 500)
        t.remove(_pairs(gone))
        for k in gone:
            del live[k]
    assert len(t) == len(live) == 40 * 100
    keys = sorted(live)
    assert t.find(_pairs(keys)).tolist() == [live[k] for k in keys]


def test_a_batch_found_as_one_run_and_one_removed_from_its_middle():
    rnd = random.Random(12)
    ks = [rnd.randbytes(16) for _ in range(2000)]
    t = KeyTable(4000)
    t.insert(_pairs(ks), np.arange(2000))
    assert t.find(_pairs(ks)).tolist() == list(range(2000))  # the whole batch: one run
    t.remove(_pairs(ks[700:701]))
    want = list(range(2000))
    want[700] = -1
    assert t.find(_pairs(ks)).tolist() == want
    assert t.find(_pairs(ks[1:])).tolist() == want[1:]  # shifted: anchors land mid-run
    t.insert(_pairs(ks[700:701]), np.array([9]))  # back, at the log's end: the run is broken
    want[700] = 9
    assert t.find(_pairs(ks)).tolist() == want
