"""Tombstones (kvstore/node/tombstones.py): kept across a reopen of the side file, ended by a
fresh write, bounded in count and age, and a torn last record costs only that record."""

from __future__ import annotations

import time

from kvstore.node.tombstones import Tombstones


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_tombstones_survive_a_reopen_and_a_fresh_write_ends_one(tmp_path):
    path = tmp_path / "tombstones.bin"
    t = Tombstones(path)
    t.add([k(1), k(2), k(3)])
    t.discard([k(2)])
    t.close()  # a kill -9 leaves the same bytes: every change was flushed to the OS at once
    again = Tombstones(path)
    assert (k(1) in again, k(2) in again, k(3) in again) == (True, False, True)
    assert len(again) == 2


def test_tombstones_are_bounded_in_count_and_age(tmp_path):
    t = Tombstones(tmp_path / "t.bin", max_entries=100)
    t.add([k(i) for i in range(250)])
    assert len(t) == 100 and k(249) in t and k(0) not in t  # the oldest went first
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
    assert path.stat().st_size <= 24 * (2 * 2000 + 4096 + 2000)
    with open(path, "ab") as f:
        f.write(b"\x01" * 10)  # a record cut short by a crash
    again = Tombstones(path)
    assert len(again) == 2000 and k(1999) in again
