"""The node's lease table expires by a deadline heap (issue 22): what came due, in deadline
order, never what ended before, never what is in transfer (it is due once its transfer ends),
and the heap stays O(live) however many leases come and go."""

from __future__ import annotations

from storeutil import make_blocks

from kvstore.keys import BlockKey
from kvstore.node.leases import Lease, LeaseTable, Reservation


def _lease(t: LeaseTable, expires: float) -> Lease:
    key = BlockKey(t.next_id().to_bytes(16, "big"))
    lease = Lease(t.next_id(), key, None, memoryview(b""), None, "dram", expires, b"")  # type: ignore[arg-type]
    t.add_lease(lease)
    return lease


def test_expired_hands_back_what_came_due_and_skips_what_ended():
    t = LeaseTable(30.0)
    early, late, ended = _lease(t, 1.0), _lease(t, 5.0), _lease(t, 2.0)
    [(h, _)] = make_blocks(1)
    r = Reservation(t.next_id(), h, h.encode(), memoryview(b""), None, None, 3.0)
    t.add_reservation(r)
    t.pop_lease(ended.id)
    assert t.expired(0.5) == ([], [])
    assert t.expired(4.0) == ([early], [r])
    assert t.expired(10.0) == ([late], [])


def test_a_lease_in_transfer_is_due_when_its_transfer_ends():
    t = LeaseTable(30.0)
    lease = _lease(t, 1.0)
    assert t.start_moving(lease)
    assert t.expired(2.0) == ([], [])  # in transfer: never expired under it
    t.stop_moving(lease)
    assert t.expired(2.0) == ([lease], [])


def test_the_heap_stays_proportional_to_the_live_leases():
    t = LeaseTable(30.0)
    keep = _lease(t, 100.0)
    for _ in range(20000):  # a GET's lease: taken and released at once
        t.pop_lease(_lease(t, 50.0).id)
    assert len(t._due) <= 2 * 1 + 1024 + 1
    assert t.expired(200.0) == ([keep], [])


def test_a_owners_disk_share_counts_its_live_disk_leases_only():
    t = LeaseTable(30.0)
    disk, dram = _lease(t, 10.0), _lease(t, 10.0)
    disk.view, disk.from_disk = memoryview(bytes(4096)), True
    dram.view = memoryview(bytes(1000))
    t.charge(disk, "alpha")
    t.charge(dram, "alpha")  # not read from disk: no share
    assert t.disk_bytes["alpha"] == 4096
    t.pop_lease(disk.id)
    assert t.disk_bytes.get("alpha", 0) == 0
