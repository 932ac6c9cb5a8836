"""Non-blocking syscall loops of :class:`rdma.channel.SocketChannel`'s transfers.

``send_burst`` and ``recv_burst`` are the bodies an offloaded transfer runs in a worker
thread: they copy until done or until the socket says EAGAIN, and never wait, so waiting
for a slow peer stays on the event loop and no peer can hold a worker. ``advance`` is the
``sendmsg`` bookkeeping both the loop and the workers use.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

IOV_MAX = 512  # below the kernel's IOV_MAX (1024) with room to spare


def send_burst(sock: socket.socket, views: list[memoryview], i: int) -> tuple[int, int]:
    """Worker-thread body of an offloaded send: ``sendmsg`` from ``views[i:]`` until done or
    EAGAIN (never waits). Returns (index of the first view not yet sent, bytes sent)."""
    total = 0
    while i < len(views):
        try:
            n = sock.sendmsg(views[i : i + IOV_MAX])
        except (BlockingIOError, InterruptedError):
            break
        except OSError as exc:
            raise ConnectionError(f"send failed: {exc}") from exc
        total += n
        i = advance(views, i, n)
    return i, total


def advance(views: list[memoryview], i: int, n: int) -> int:
    """After ``sendmsg(views[i:])`` sent ``n`` bytes: drop the views sent whole, trim a part-
    sent one in place; returns the index of the first view not yet sent."""
    while n:
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def recv_burst(sock: socket.socket, mv: memoryview, pos: int, then: Callable | None) -> tuple[int, Any]:
    """Worker-thread body of an offloaded ``recv_into``: fill ``mv[pos:]`` until done or EAGAIN
    (never waits). Returns the new position and, once ``mv`` is full, ``then(mv)`` (None until
    then, or without ``then``); ConnectionError on EOF or reset."""
    end = mv.nbytes
    while pos < end:
        try:
            n = sock.recv_into(mv[pos:])
        except (BlockingIOError, InterruptedError):
            break
        except OSError as exc:
            raise ConnectionError(f"recv failed: {exc}") from exc
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {pos} of {end} bytes")
        pos += n
    return pos, (then(mv) if then is not None and pos == end else None)
