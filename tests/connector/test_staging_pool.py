"""The loader's staging pool keeps its memory bounded: slots made for concurrent loads beyond
the ones allocated up front are freed when given back, not kept for ever, and no more than
its bound are ever lent at once (past it a load waits for one, within its deadline)."""

import asyncio

import pytest
import torch

from connector.staging import StagingFull, StagingPool


def _pool(slots: int, most: int) -> StagingPool:
    return StagingPool(slots, most, 4, 64, (16,), torch.float32, pin=False)


async def test_staging_pool_frees_the_slots_it_added_for_concurrent_loads():
    pool = _pool(2, 8)
    assert pool.idle == 2
    up_front = [await pool.take(1.0) for _ in range(2)]
    slots = up_front + [await pool.take(1.0) for _ in range(3)]  # five loads at once: three added
    assert pool.fresh == 3 and pool.idle == 0 and pool.lent == 5
    for s in slots:
        pool.give(s)
    assert pool.idle == 2 and pool.lent == 0  # the up-front two kept, the added three freed
    again = [await pool.take(1.0) for _ in range(2)]
    assert pool.fresh == 3  # reused, none added
    assert {id(s) for s in again} == {id(s) for s in up_front}  # the registered ones


async def test_staging_pool_lends_at_most_its_bound_and_hands_a_given_slot_to_the_waiter():
    pool = _pool(2, 3)
    slots = [await pool.take(1.0) for _ in range(3)]
    assert pool.lent == 3 and pool.fresh == 1
    waiting = asyncio.ensure_future(pool.take(5.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the bound is reached: no fourth slot is made
    pool.give(slots[0])
    got = await waiting
    assert got is slots[0] and pool.lent == 3 and pool.fresh == 1
    with pytest.raises(StagingFull):
        await pool.take(0.05)  # nothing given back within the wait
    for s in [got, *slots[1:]]:
        pool.give(s)
    assert pool.lent == 0 and pool.idle == 2


async def test_a_wait_that_ends_as_its_slot_is_handed_over_gives_the_slot_back():
    pool = _pool(1, 1)
    only = await pool.take(1.0)
    waiting = asyncio.ensure_future(pool.take(5.0))
    await asyncio.sleep(0.01)
    pool.give(only)  # handed to the waiter ...
    waiting.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.lent == 0 and pool.idle == 1  # not lost
    assert await pool.take(0.05) is only


def test_the_bound_is_never_below_the_up_front_slots():
    assert _pool(3, 1).most == 3
