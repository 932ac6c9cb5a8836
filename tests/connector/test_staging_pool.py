"""The loader's staging pool keeps its memory bounded: slots made for concurrent loads beyond
the ones allocated up front are freed when given back, not kept for ever."""

import torch

from connector.staging import StagingPool


def test_staging_pool_frees_the_slots_it_added_for_concurrent_loads():
    pool = StagingPool(2, 4, 64, (16,), torch.float32, pin=False)
    assert pool.idle == 2
    up_front = [pool.take() for _ in range(2)]
    slots = up_front + [pool.take() for _ in range(3)]  # five loads at once: three slots added
    assert pool.fresh == 3 and pool.idle == 0
    for s in slots:
        pool.give(s)
    assert pool.idle == 2  # the up-front two kept, the added three freed
    again = [pool.take() for _ in range(2)]
    assert pool.fresh == 3  # reused, none added
    assert {id(s) for s in again} == {id(s) for s in up_front}  # the registered ones
