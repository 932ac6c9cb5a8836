"""Opening a connection to an IP literal needs no thread: with the event loop's default
thread pool busy (other getaddrinfo calls, other to_thread work), it still connects at once.
Found as test_daemon_stress's 32 clients, whose first connects queued in that pool behind each
other past the 1 s connect timeout once the client's deadline handling changed."""

from __future__ import annotations

import asyncio
import socket
import threading

from rdma.channel import SocketChannel


async def test_connect_to_an_ip_literal_does_not_wait_for_the_default_thread_pool():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    loop = asyncio.get_running_loop()
    release = threading.Event()
    # occupy every worker of the loop's default pool
    busy = [loop.run_in_executor(None, release.wait) for _ in range(64)]
    try:
        ch = await asyncio.wait_for(SocketChannel.connect("127.0.0.1", port), 1.0)
        ch.close()
    finally:
        release.set()
        await asyncio.gather(*busy)
        srv.close()
