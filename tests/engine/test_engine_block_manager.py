"""Page pool and prefix cache bookkeeping, including a random-operation property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, PoolIntegrityError
from kvstore.keys import Namespace

NS = Namespace("test-model", "float32", 4)


def test_engine_take_is_check_then_commit():
    bm = BlockManager(4, 4, NS)
    a = bm.take((), 3)
    assert not bm.can_take((), 2)
    with pytest.raises(MemoryError):
        bm.take((), 2)
    assert bm.num_available == 1  # the failed call changed nothing
    bm.check([a])
    bm.release(a)
    bm.check([])


def test_engine_prefix_cache_hit_lru_and_eviction():
    bm = BlockManager(4, 4, NS)
    toks = list(range(100, 112))  # 3 full pages
    pages = bm.take((), 3)
    keys: list = []
    bm.register(toks, pages, keys, num_computed=12)
    assert len(keys) == 3 and len(bm.cache) == 3
    bm.release(pages)
    assert len(bm.lru) == 3 and bm.num_available == 4
    assert bm.match_prefix(toks, 10) == pages
    assert bm.match_prefix(toks[:4] + [0] * 8, 10) == pages[:1]
    # taking the hit pages removes them from the LRU; the new page comes from the free list
    new = bm.take(pages[:2], 1)
    bm.check([pages[:2] + new])
    assert not bm.can_take(pages[:2], 2)
    # a new allocation evicts the least recently released page (the tail, released first... last)
    more = bm.take((), 1)
    assert bm.evictions == 1 and pages[2] not in bm.lru
    bm.check([pages[:2] + new, more])
    bm.release(pages[:2] + new)
    bm.release(more)
    bm.check([])


def test_engine_token_mismatch_is_a_miss():
    bm = BlockManager(4, 4, NS)
    toks = [1, 2, 3, 4]
    pages = bm.take((), 1)
    bm.register(toks, pages, [], 4)
    bm.release(pages)
    bm.page_tokens[pages[0]] = (9, 9, 9, 9)  # as if two prefixes collided on one key
    assert bm.match_prefix(toks, 1) == []


def test_engine_integrity_check_catches_corruption():
    bm = BlockManager(4, 4, NS)
    p = bm.take((), 2)
    with pytest.raises(PoolIntegrityError):
        bm.check([p[:1]])  # a reference nobody accounts for
    bm.free_pages.append(p[0])
    with pytest.raises(PoolIntegrityError):
        bm.check()
    with pytest.raises(PoolIntegrityError):
        BlockManager(2, 4, NS).release([0])


ops = st.lists(
    st.tuples(st.sampled_from(["new", "extend", "finish"]), st.integers(0, 7), st.integers(1, 9)), max_size=60
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_engine_random_operations_keep_the_pool_consistent(program):
    bm = BlockManager(10, 4, NS)
    live: dict[int, tuple[list[int], list[int], list]] = {}  # id -> (tokens, pages, keys)
    nid = 0
    for op, a, b in program:
        if op == "new":
            toks = [a % 3] * 4 + list(range(b))  # shared first page across many requests
            hit = bm.match_prefix(toks, (len(toks) - 1) // 4)
            need = bm.pages_needed(len(hit), len(toks))
            if bm.can_take(hit, need):
                pages = hit + bm.take(hit, need)
                keys: list = []
                bm.register(toks, pages, keys, len(toks))
                live[nid] = (toks, pages, keys)
                nid += 1
        elif op == "extend" and live:
            toks, pages, keys = live[list(live)[a % len(live)]]
            need = bm.pages_needed(len(pages), len(toks) + b)
            if bm.can_take((), need):
                pages += bm.take((), need)
                toks += [a] * b
                bm.register(toks, pages, keys, len(toks))
        elif op == "finish" and live:
            _, pages, _ = live.pop(list(live)[a % len(live)])
            bm.release(pages)
        bm.check([p for _, p, _ in live.values()])
    for _, pages, _ in live.values():
        bm.release(pages)
    bm.check([])
    assert bm.num_available == 10
