"""A reply's deadline starts when it is queued, not when the kernel's send buffer is full (issue
34, finding 8), against a real daemon: a client pipelines GETs and never reads. Before: every
reply went into the kernel's autotuned send buffer (MBs), nothing stayed queued in the daemon,
and the connection lived until the idle timeout. Now the daemon closes it once a reply handed
to the kernel is still unread at the transfer deadline, and ``limits.send_buffer`` bounds
what sits in the kernel for it meanwhile."""

from __future__ import annotations

import time

from daemonutil import RawPeer, unsent_bytes
from polling import until

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.results import Status

TOK_A = "tok-tenant-a1"
KiB = 1 << 10


async def test_a_pipeline_never_read_is_closed_at_the_deadline_and_holds_little(authed_daemon, ns, blocks_of):
    d = authed_daemon({TOK_A: "alpha"}, limits={"transfer_timeout_s": 1.0, "send_buffer": "256KiB"})
    a = NodeClient(d.addr, ClientConfig(token=TOK_A, namespaces=(ns,), op_timeout_s=30, probe_interval_s=60))
    [(h, p)] = blocks_of(ns.with_tenant("alpha"), 1, 256 * KiB, seed=1)
    assert [r.status for r in await a.put([(h, p)])] == [Status.STORED]
    peer = RawPeer(d.data_port, rcvbuf=64 * KiB)
    peer.hello(TOK_A, ns)
    local = peer.sock.getsockname()[1]
    for _ in range(8):  # 2 MiB of replies, none read
        peer.request({"op": "GET", "keys": h.key.raw})
    held = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        held.append(unsent_bytes(d.data_port, local) or 0)
        time.sleep(0.02)
    # what the kernel holds for the non-reader: about the bound (the kernel doubles it)
    assert max(held) <= 2 * 256 * KiB + 64 * KiB, max(held)
    # closed at the deadline (1 s from each reply's queueing; 2 s for the request), not idle's
    until(
        lambda: unsent_bytes(d.data_port, local),
        15,
        "the non-reader's connection closed",
        lambda q: q is None,
    )
    peer.close()
    assert (await a.lookup([h.key])).names() == ["dram"]  # the daemon serves on
    await a.close()
