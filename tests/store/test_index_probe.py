"""The tier index's bulk probe (LruIndex.probe) against the per-key reference: ``key in
index``, then ``sees(index.namespace(key))``. The probe skips its per-key namespace pass when
no block of the tier holds a namespace the session refuses; these tests drive the index
through adds, replacements and removals (ids freed and reused, blocks with no namespace)
so that shortcut is taken and not taken, and compare every answer."""

from __future__ import annotations

import random

import numpy as np

from kvstore.keys import KeyBatch
from kvstore.keytable import key_pairs
from kvstore.node.tiers.index import _SYNC_EVERY, LruIndex
from kvstore.node.tiers.namespace_ids import NamespaceIds

NS = [None, b"a" * 16, b"b" * 16, b"c" * 16]


def _reference(idx: LruIndex, keys: list[bytes], sees) -> tuple[list[bool], list[bool]]:
    held = [k in idx for k in keys]
    return held, [h and sees(idx.namespace(k)) for h, k in zip(held, keys)]


def _probe(idx: LruIndex, keys: list[bytes], sees):
    return idx.probe(key_pairs(KeyBatch(b"".join(keys))), sees)


def _check(idx: LruIndex, keys: list[bytes], sees) -> bool:
    """Assert the probe equals the reference; whether the tier held a block ``sees`` refuses."""
    held, visible = _probe(idx, keys, sees)
    want_held, want_visible = _reference(idx, keys, sees)
    assert held.dtype == bool and visible.dtype == bool
    assert len(held) == len(visible) == len(keys)
    assert held.tolist() == want_held
    assert visible.tolist() == want_visible
    return any(not sees(idx.namespace(k)) for k in idx.keys())  # noqa: SIM118 (no __iter__)


def test_probe_is_exact_per_key_through_adds_replacements_and_removals():
    rng = random.Random(18)
    idx = LruIndex()
    pool = [rng.randbytes(16) for _ in range(400)]
    views = [
        lambda ns: ns == NS[1],
        lambda ns: ns in (NS[1], NS[2]),
        lambda ns: ns is not None,  # a peer session: every namespace, never "none"
        lambda ns: False,
    ]
    shortcut = mixed = 0
    # phases: one tenant's blocks only, then two, then every namespace and none; each phase
    # starts by replacing (or dropping) the blocks of namespaces it does not write
    phases = [NS[1:2], NS[1:3], NS, NS[1:2], NS[:2]]
    for step in range(300):
        spaces = phases[step * len(phases) // 300]
        if step % (300 // len(phases)) == 0:
            for k in list(idx.keys()):
                if idx.namespace(k) not in spaces:
                    if rng.random() < 0.5:
                        idx._index_pop(k)
                    else:
                        idx._index_add(k, 7, 64, 1024, step, rng.choice(spaces))
        for _ in range(rng.randrange(1, 12)):
            k = rng.choice(pool)
            if rng.random() < 0.35:
                idx._index_pop(k)
            else:  # a new block or a replacement under another namespace
                idx._index_add(k, rng.randrange(1 << 20), 64, 1024, step, rng.choice(spaces))
        keys = rng.sample(pool, rng.randrange(0, 200)) + [rng.randbytes(16)]
        for sees in views:
            if _check(idx, keys, sees):
                mixed += 1
            else:
                shortcut += 1
    assert shortcut > 50 and mixed > 50, (shortcut, mixed)


def test_a_block_with_no_namespace_is_never_visible_to_a_tenant():
    """Id 0 ("no namespace") is counted like any other: one such block in the tier and the
    tenant's probe reads each key's id (that block answers absent); once it is gone, the
    shortcut answers the tenant's own blocks."""
    idx = LruIndex()
    mine, bare = b"m" * 16, b"n" * 16
    idx._index_add(mine, 0, 64, 1024, 1, NS[1])
    idx._index_add(bare, 1, 64, 1024, 1, None)
    sees = lambda ns: ns == NS[1]  # noqa: E731
    held, visible = _probe(idx, [mine, bare, b"x" * 16], sees)
    assert held.tolist() == [True, True, False] and visible.tolist() == [True, False, False]
    idx._index_pop(bare)
    held, visible = _probe(idx, [mine, bare], sees)
    assert held.tolist() == [True, False] and visible.tolist() == [True, False]
    idx._index_add(mine, 0, 64, 1024, 2, None)  # replaced by a block of no namespace
    held, visible = _probe(idx, [mine], sees)
    assert held.tolist() == [True] and visible.tolist() == [False]


def test_all_held_in_counts_blocks_per_id_including_none():
    ids = NamespaceIds()
    assert ids.all_held_in(frozenset()), "no blocks: nothing is hidden"
    ids.acquire(None)
    assert not ids.all_held_in(frozenset())
    assert ids.all_held_in(frozenset({0}))
    a = ids.acquire(NS[1])
    assert not ids.all_held_in(frozenset({a}))
    ids.release(0)
    assert ids.all_held_in(frozenset({a}))
    ids.release(a)
    assert ids.all_held_in(frozenset()), "the freed id holds no block"
    assert np.array_equal(np.zeros(0, dtype=bool), _probe(LruIndex(), [], lambda ns: True)[1])


def test_probe_after_more_changes_than_one_sync_holds_and_with_repeated_keys():
    """Writes with no probe between them past the table's catch-up bound (it then syncs on
    its own), removals of half, and a probe batch that names keys twice: exact still."""
    rng = random.Random(181)
    idx = LruIndex()
    keys = [rng.randbytes(16) for _ in range(_SYNC_EVERY + 3000)]
    for i, k in enumerate(keys):
        idx._index_add(k, i, 64, 1024, 1, NS[1 + i % 2])
    for k in keys[::2]:
        idx._index_pop(k)
    asked = keys[:5000] + keys[:7] + [rng.randbytes(16)]
    for sees in (lambda ns: ns == NS[1], lambda ns: ns is not None):
        _check(idx, asked, sees)
    held, _ = _probe(idx, asked, lambda ns: True)
    assert int(held.sum()) == 2500 + 3, "odd keys of the first 5,000, and keys 1, 3, 5 again"
