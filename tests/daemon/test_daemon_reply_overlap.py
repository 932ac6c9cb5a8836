"""A connection's next request is read and prepared while its previous reply is still being
sent (kvstore/daemon/replies.py): replies stay in request order, a reply queued or in flight
keeps its slots (its packed lease held, marked in transfer) until its bytes have left, and a
reader that stalls with replies queued costs only its connection, whose leases all end.

A reply is queued only once the daemon's socket buffer (4 MiB asked, 8 MiB granted) is full, so
each scenario makes the first GET's reply larger than that and keeps the reader from reading
it: the second GET is then prepared, its reply queued behind the first."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from daemonutil import RawPeer, frame
from polling import until
from scraping import scrape

from kvstore import protocol as P
from kvstore.results import Status

MiB = 1 << 20
BLOCK = 3 * MiB + (512 << 10)  # one per 4 MiB slab slot
DRAM = {"capacity": "16MiB", "slab_size": "4MiB"}  # four slots, no more


@pytest.fixture
def overlap(start_daemon, ns, blocks_of):
    """A daemon whose DRAM holds exactly four blocks, with blocks Z1..Z3 and X stored there;
    returns (daemon, writer, [Z1, Z2, Z3], X)."""

    def start(**limits):
        d = start_daemon(dram=DRAM, limits=limits)
        writer = RawPeer(d.data_port, timeout=30)
        writer.hello("", ns)
        *zs, x = blocks_of(ns, 4, BLOCK, seed=7)
        for h, payload in [*zs, x]:
            _put(writer, h, payload)
        writer.request({"op": "EXISTS", "keys": b"".join(h.key.raw for h, _ in [*zs, x])})
        assert writer.reply()["tiers"] == b"\x02" * 4, "all four in DRAM"
        return d, writer, zs, x

    return start


def _put(p: RawPeer, h, payload: bytes) -> dict:
    p.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(payload))
    p.send(payload)
    rep = p.reply()
    assert rep["st"][0] == int(Status.STORED), rep
    return rep


def _both_read(d, reader: RawPeer) -> None:
    """Wait until the daemon has read the reader's two GETs: the second is then prepared (its
    lease taken with no await after its header), its reply queued behind the first's."""
    reader.until_read("both GETs read by the daemon")
    time.sleep(0.3)


def _stalled_reader(d, ns, zs, hx) -> RawPeer:
    """A reader with a small receive buffer that sent GET [Z1, Z2, Z3] then GET [X] and reads
    nothing yet: the first reply stalls in the daemon's socket buffer, the second is prepared
    behind it (both read by the daemon when this returns)."""
    reader = RawPeer(d.data_port, rcvbuf=64 << 10, timeout=30)
    reader.hello("", ns)
    reader.send(
        frame({"op": "GET", "rid": 1, "keys": b"".join(h.key.raw for h, _ in zs)})
        + frame({"op": "GET", "rid": 2, "keys": hx.key.raw})
    )
    _both_read(d, reader)
    return reader


def _leases(p: RawPeer) -> int:
    p.request({"op": "STATS"})
    return p.reply()["stats"]["node"]["leases_active"]


def test_pipelined_gets_on_one_connection_are_answered_in_order_and_whole(start_daemon, ns, blocks_of):
    """Sixteen GETs of 64 blocks of 64 KiB, all sent before any reply is read, by a reader
    that reads in small steps: every reply comes in request order, its payload right after
    it, each block's bytes its own (a reply sent while another is queued would cut into it)."""
    d = start_daemon(dram={"capacity": "96MiB", "slab_size": "4MiB"})
    writer = RawPeer(d.data_port, timeout=30)
    writer.hello("", ns)
    blocks = blocks_of(ns, 1024, 64 << 10, seed=3)
    batches = [blocks[i : i + 64] for i in range(0, len(blocks), 64)]
    for batch in batches:
        writer.request({"op": "PUT", "hdrs": [h.encode() for h, _ in batch]}, plen=64 * (64 << 10))
        writer.send(b"".join(p for _, p in batch))
        assert writer.reply()["st"] == bytes([int(Status.STORED)]) * 64
    reader = RawPeer(d.data_port, rcvbuf=64 << 10, timeout=30)
    reader.hello("", ns)
    reader.send(
        b"".join(
            frame({"op": "GET", "rid": 100 + i, "keys": b"".join(h.key.raw for h, _ in batch)})
            for i, batch in enumerate(batches)
        )
    )
    time.sleep(1.0)  # the first replies fill the daemon's buffer; the next ones queue
    for i, batch in enumerate(batches):
        rep = reader.reply()
        assert rep["rid"] == 100 + i, f"reply {i} out of order: rid {rep['rid']}"
        assert list(rep["st"]) == [int(Status.HIT)] * 64
        got = bytearray()
        while len(got) < 64 * (64 << 10):  # small reads: the daemon's socket has room often
            got += reader.exact(min(256 << 10, 64 * (64 << 10) - len(got)))
        assert got == b"".join(p for _, p in batch), f"reply {i}: another block's bytes"
    # the last reply's lease ends once its send returns, just after its last byte left
    until(lambda: _leases(writer), 10, "the GETs' leases released", lambda n: n == 0)


def test_a_slot_of_a_queued_reply_is_not_reused_when_its_block_is_deleted(overlap, ns, blocks_of):
    """GET [Z1, Z2, Z3] stalls in the daemon's socket buffer; GET [X] is prepared behind it.
    Another connection deletes X and stores Y, same size, in the full DRAM: X's slot must not be
    Y's while X's reply waits to be sent. The reader then reads both replies: X's bytes are X's."""
    d, writer, zs, (hx, px) = overlap()
    [(hy, py)] = blocks_of(ns, 1, BLOCK, seed=8)
    reader = _stalled_reader(d, ns, zs, hx)
    writer.request({"op": "DELETE", "keys": hx.key.raw})
    assert writer.reply()["res"] == b"\x01"
    _put(writer, hy, py)  # a freed slot would be X's: the only one not held by the replies
    first = reader.reply()
    assert first["rid"] == 1 and list(first["st"]) == [int(Status.HIT)] * 3
    assert reader.exact(3 * BLOCK) == b"".join(p for _, p in zs)
    second = reader.reply()
    assert second["rid"] == 2 and list(second["st"]) == [int(Status.HIT)]
    assert reader.exact(BLOCK) == px, "X's reply carried another block's bytes"
    writer.request({"op": "EXISTS", "keys": hx.key.raw + hy.key.raw})
    assert writer.reply()["tiers"][0] == 0  # X is gone once its reply has left
    assert _leases(writer) == 0


def test_a_reader_that_stalls_with_a_reply_queued_costs_only_its_connection(overlap, ns, blocks_of):
    """The same two GETs, never read: at the transfer deadline the connection is closed and
    counted once, and both replies' leases end with it, the queued one's too: the four blocks
    delete and four new ones take the whole DRAM. Another connection is served meanwhile."""
    d, writer, zs, (hx, px) = overlap(transfer_timeout_s=2.0)
    reader = _stalled_reader(d, ns, zs, hx)
    assert _leases(writer) == 2, "both replies hold their lease while queued"
    other = RawPeer(d.data_port, timeout=30)
    other.hello("", ns)
    other.request({"op": "GET", "keys": hx.key.raw})
    assert other.reply()["st"][0] == int(Status.HIT)
    assert other.exact(BLOCK) == px
    until(
        lambda: scrape(d.admin).value("tierkv_timeouts_total", 0.0, kind="transfer"),
        30.0,
        "one transfer timeout counted",
        ok=lambda n: n == 1,
    )
    assert reader.closed_by_peer()
    assert scrape(d.admin).value("tierkv_timeouts_total", 0.0, kind="request") == 0
    until(lambda: _leases(writer), 10.0, "the stalled connection's leases ended", ok=lambda n: n == 0)
    writer.request({"op": "DELETE", "keys": b"".join(h.key.raw for h, _ in [*zs, (hx, px)])})
    assert writer.reply()["res"] == b"\x01" * 4
    fresh = blocks_of(ns, 4, BLOCK, seed=9)
    assert [P.PUT_TIERS[_put(writer, h, p)["tier"][0]] for h, p in fresh] == ["dram"] * 4, (
        "every freed slot reused"
    )


def test_stop_sends_the_queued_replies_before_closing(start_daemon, ns, blocks_of):
    """SIGTERM while a reader has a reply in flight and one queued: the daemon finishes both
    (within its grace) before it closes the connection and exits."""
    d = start_daemon(dram={"capacity": "64MiB", "slab_size": "4MiB"})
    writer = RawPeer(d.data_port, timeout=30)
    writer.hello("", ns)
    blocks = blocks_of(ns, 6, 3 * MiB, seed=5)
    for h, payload in blocks:
        _put(writer, h, payload)
    reader = RawPeer(d.data_port, rcvbuf=64 << 10, timeout=30)
    reader.hello("", ns)
    reader.send(
        frame({"op": "GET", "rid": 1, "keys": b"".join(h.key.raw for h, _ in blocks[:4])})
        + frame({"op": "GET", "rid": 2, "keys": b"".join(h.key.raw for h, _ in blocks[4:])})
    )
    _both_read(d, reader)
    writer.close()
    got: list = []

    def read_all():
        for _ in range(2):
            rep = reader.reply()
            got.append((rep["rid"], reader.exact(rep["st"].count(int(Status.HIT)) * 3 * MiB)))

    d.signal(signal.SIGTERM)
    time.sleep(0.5)  # the daemon is stopping while both replies wait on this reader
    t = threading.Thread(target=read_all)
    t.start()
    t.join(30)
    assert [rid for rid, _ in got] == [1, 2]
    assert got[0][1] == b"".join(p for _, p in blocks[:4]) and got[1][1] == b"".join(p for _, p in blocks[4:])
    assert reader.closed_by_peer()


def test_stop_does_not_cut_a_request_that_began_after_the_reader_was_judged_idle(start_daemon, ns, blocks_of):
    """SIGTERM while a reader's reply is still being sent and no request is being read: the
    connection is to close once the reply has left. A PUT that the peer began meanwhile is
    served to its end (its reply sent), not cut when the earlier reply's last byte leaves."""
    d = start_daemon(dram={"capacity": "64MiB", "slab_size": "4MiB"})
    writer = RawPeer(d.data_port, timeout=30)
    writer.hello("", ns)
    blocks = blocks_of(ns, 5, 3 * MiB, seed=9)
    for h, payload in blocks[:4]:
        _put(writer, h, payload)
    writer.close()
    reader = RawPeer(d.data_port, rcvbuf=64 << 10, timeout=30)
    reader.hello("", ns)
    reader.send(frame({"op": "GET", "rid": 1, "keys": b"".join(h.key.raw for h, _ in blocks[:4])}))
    reader.until_read("the GET read by the daemon")
    time.sleep(0.3)  # its reply waits on this reader; the connection reads no request
    d.signal(signal.SIGTERM)
    time.sleep(0.5)  # the daemon is stopping: this connection closes once its reply has left
    h, payload = blocks[4]
    half = len(payload) // 2
    reader.request({"op": "PUT", "hdrs": [h.encode()]}, plen=len(payload))
    reader.send(payload[:half])
    time.sleep(0.3)  # the daemon reads the PUT's payload
    rep = reader.reply()
    assert rep["rid"] == 1
    assert reader.exact(4 * 3 * MiB) == b"".join(p for _, p in blocks[:4])
    time.sleep(0.3)  # the GET's reply has left: the sender is idle
    try:
        reader.send(payload[half:])
        rep = reader.reply()
    except OSError as exc:
        raise AssertionError(f"the PUT begun before the reply had left was cut: {exc!r}") from None
    assert rep["st"] == bytes([int(Status.STORED)]), rep
    assert reader.closed_by_peer()
