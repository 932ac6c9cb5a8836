"""Tombstones (kvstore/node/tombstones.py): kept across a reopen of the side file with who
deleted and why, ended by a fresh write, bounded per tenant in count and in age, a torn last
record costs only that record, and the file of the version before is taken in."""

from __future__ import annotations

import struct
import time

from kvstore.node.tombstones import LEGACY_FILE_NAME, Tombstone, Tombstones


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_tombstones_survive_a_reopen_and_a_fresh_write_ends_one(tmp_path):
    path = tmp_path / "tombstones.bin"
    t = Tombstones(path)
    t.add([k(1), k(2)], "alpha")
    t.add([k(3)], "*", "evict")
    t.discard([k(2)])
    t.close()  # a kill -9 leaves the same bytes: every change was flushed to the OS at once
    again = Tombstones(path)
    assert (k(1) in again, k(2) in again, k(3) in again) == (True, False, True)
    assert len(again) == 2 and again.by_tenant() == {"alpha": 1, "*": 1}
    one, three = again.get(k(1)), again.get(k(3))
    assert (one.tenant, one.cause, three.tenant, three.cause) == ("alpha", "delete", "*", "evict")
    assert abs(one.at - time.time()) < 60


def test_tombstones_are_bounded_per_tenant_in_count_and_in_age(tmp_path):
    t = Tombstones(tmp_path / "t.bin", per_tenant=100)
    t.add([k(1000)], "alpha")
    t.add([k(i) for i in range(250)], "beta")
    assert len(t) == 101 and k(249) in t and k(0) not in t  # beta's oldest went first
    assert k(1000) in t and t.by_tenant() == {"alpha": 1, "beta": 100}  # alpha's stays
    t.add([k(1000)], "beta")  # deleted again by another: it is that one's now
    assert t.by_tenant() == {"beta": 100} and t.get(k(1000)).tenant == "beta"
    t.close()
    assert Tombstones(tmp_path / "t.bin", per_tenant=10).by_tenant() == {"beta": 10}  # newest kept
    young = Tombstones(None, max_age_s=0.05)
    young.add([k(1)])
    assert k(1) in young
    time.sleep(0.1)
    assert k(1) not in young and len(young) == 0


def test_a_torn_last_record_keeps_the_rest_and_the_file_is_compacted(tmp_path):
    path = tmp_path / "t.bin"
    t = Tombstones(path)
    for _ in range(5):  # many changes of few keys: the file is rewritten, not grown for ever
        t.add([k(i) for i in range(2000)])
    t.close()
    assert path.stat().st_size <= 28 * (2 * 2000 + 4096 + 2000)
    with open(path, "ab") as f:
        f.write(b"\x01" * 10)  # a record cut short by a crash
    again = Tombstones(path)
    assert len(again) == 2000 and k(1999) in again


def test_the_file_of_the_version_before_is_taken_in_and_removed(tmp_path):
    legacy = tmp_path / LEGACY_FILE_NAME
    now = time.time()
    legacy.write_bytes(
        b"".join(struct.pack("<16sd", k(i), now) for i in range(3)) + struct.pack("<16sd", k(1), 0.0)
    )
    t = Tombstones.beside(tmp_path)
    assert (k(0) in t, k(1) in t, k(2) in t) == (True, False, True)
    assert t.get(k(0)) == Tombstone(now, "", "delete") and not legacy.exists()
    t.close()
    assert len(Tombstones.beside(tmp_path)) == 2
