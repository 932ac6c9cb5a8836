"""A channel's socket is watched for room only while a send waits for it. The watch is kept
across waits (kvstore's sends wait once per socket buffer drained), but epoll is
level-triggered: a writable socket left registered with no one waiting woke the event loop on
every pass while a worker thread sent the rest of a large reply, and the daemon's loop spun
(its GIL time went to select and loop bookkeeping, not sendmsg: issue 35's profile)."""

from __future__ import annotations

import asyncio
import socket

from rdma.channel import SocketChannel


async def test_a_writable_socket_nobody_waits_on_does_not_wake_the_loop():
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        ch = SocketChannel(a)
        fired = 0
        on_ready = ch._writer._on_ready

        def counted() -> None:
            nonlocal fired
            fired += 1
            on_ready()

        ch._writer._on_ready = counted
        await ch._wait(write=True)  # room now: the wait ends at the first pass
        woke = fired
        for _ in range(50):  # nobody waits now; the socket stays writable all along
            await asyncio.sleep(0)
        assert fired - woke <= 1, f"the loop was woken {fired - woke} times for a send nobody waits for"
        # and a later wait still sees room (the watch comes back when someone waits)
        await asyncio.wait_for(ch._wait(write=True), 5)
        ch.close()
    finally:
        a.close()
        b.close()
