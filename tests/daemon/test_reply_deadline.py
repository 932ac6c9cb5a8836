"""A reply's deadline starts when it is queued, not when the kernel's send buffer is full (issue
34, finding 8), against a real daemon: a client pipelines GETs and never reads. Before: every
reply went into the kernel's autotuned send buffer (MBs), nothing stayed queued in the daemon,
and the connection lived until the idle timeout. Now the daemon closes it once a reply handed
to the kernel is still unread at the transfer deadline, and ``limits.send_buffer`` bounds
what sits in the kernel for it meanwhile."""

from __future__ import annotations

import time

from daemonutil import RawPeer
from polling import until

from kvstore.client.node import ClientConfig, NodeClient
from kvstore.results import Status

TOK_A = "tok-tenant-a1"
KiB = 1 << 10


def tx_queue(port: int, local_port: int) -> int | None:
    """Bytes the daemon listening on ``port`` has sent to ``local_port`` and not had acknowledged
    (its send queue in /proc/net/tcp); None once that connection is no longer established."""
    with open("/proc/net/tcp") as f:
        for row in (line.split() for line in f.readlines()[1:]):
            here, there = int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16)
            if here == port and there == local_port and row[3] == "01":
                return int(row[4].split(":")[0], 16)
    return None


async def test_a_pipeline_never_read_is_closed_at_the_deadline_and_holds_little(
    start_daemon, tmp_path, ns, blocks_of
):
    f = tmp_path / "tokens.txt"
    f.write_text(f"{TOK_A} alpha\n")
    d = start_daemon(auth={"token_file": str(f)}, limits={"transfer_timeout_s": 1.0, "send_buffer": "256KiB"})
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
        held.append(tx_queue(d.data_port, local) or 0)
        time.sleep(0.02)
    # what the kernel holds for the non-reader: about the bound (the kernel doubles it)
    assert max(held) <= 2 * 256 * KiB + 64 * KiB, max(held)
    # closed at the deadline (1 s from each reply's queueing; 2 s for the request), not idle's
    until(lambda: tx_queue(d.data_port, local), 15, "the non-reader's connection closed", lambda q: q is None)
    peer.close()
    assert await a.exists([h.key]) == ["dram"]  # the daemon serves on
    await a.close()
