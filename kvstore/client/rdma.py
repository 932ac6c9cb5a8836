"""The client's side of RDMA: the verbs device when this host has one, the staging buffers
registered with it, a queue pair per connection, and the fall-back to TCP.

Selection (docs/rdma.md), through the one selection function
(:func:`rdma.transport.select_transport`) with the messages naming ``transport``:

* ``tcp`` never opens a device.
* ``auto`` opens the device when this host has one; when it has none, the client uses TCP and
  says so in one log line per process. Per connection HELLO offers a queue pair; a node that
  answers without RDMA is used over TCP (one log line per node).
* ``rdma`` without a device raises TransportError at construction. A node that answers without
  RDMA is refused: TransportError while connecting, which the client treats like a failed
  connection (the node is marked down, its calls are misses / dropped writes).

At run time (:func:`move`), any verbs failure (an exception, a failed work request) makes the
affected pairs misses or dropped writes, counted in ``rdma_failures``, never an exception to
the caller; the connection then falls back to TCP. A :class:`ClientRdma` is shared by the
NodeClients of one ClusterClient: the device is looked for once, when it is
made, and opened at most once (buffers registered once); with no device (``tcp``, or ``auto``
on a host without one) no connection offers a queue pair or tries a device. One event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rdma.transport import MODES, Region, TransportError, fallback_reason, select_transport

log = logging.getLogger("kvstore.client.node")
_said: set[str] = set()  # log lines already written by this process (one per reason and node)


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info(message)


class ClientRdma:
    """One client's RDMA state. ``device`` is None when the client moves bytes over TCP only."""

    def __init__(self, mode: str = "auto", device: str = "", gid_index: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"transport: expected one of {list(MODES)}, got {mode!r}")
        from rdma.verbs import device_available

        self.mode = mode
        self.device = None
        local = mode != "tcp" and device_available()
        if select_transport(mode, local, True, key="transport") == "tcp":  # raises: rdma, no device
            if mode == "auto":
                _say_once("local", f"event=transport selected=tcp reason={fallback_reason(False, True)!r}")
            return
        try:
            self.device = _open_device(device, gid_index)
        except TransportError:
            if mode == "rdma":
                raise
            log.warning("event=transport selected=tcp reason='RDMA device unusable'", exc_info=True)

    def register(self, buf: Any) -> Region | None:
        """Register a staging buffer (writable, contiguous) once, so one-sided transfers can use
        it; a no-op (None) over TCP. TransportError when the device refuses."""
        return self.device.register(buf) if self.device is not None else None

    def covers(self, views: Sequence[Any]) -> bool:
        """True when this client moves bytes one-sidedly and every buffer is registered."""
        return self.device is not None and self.device.registrations.covers(views)

    def offer(self):
        """A new queue pair to offer in HELLO (its ``.info``), or None over TCP. A device that
        cannot make one is a TCP connection under ``auto`` and TransportError under ``rdma``."""
        if self.device is None:
            return None
        try:
            return self.device.queue_pair()
        except TransportError:
            if self.mode == "rdma":
                raise
            log.warning("event=rdma_offer_failed", exc_info=True)
            return None

    def attach(self, conn, qp, node: str) -> None:
        """After HELLO: decide this connection's transport from what we offered (``qp``) and what
        the node answered (``conn.peer_rdma``); for RDMA connect ``qp`` and hand it to ``conn``,
        else destroy it. TransportError under ``rdma`` when the node offers no RDMA."""
        peer = conn.peer_rdma
        try:
            chosen = select_transport(self.mode, qp is not None, peer is not None, key="transport")
            if chosen == "rdma":
                qp.connect(peer.qp)
                conn.use_verbs(qp, peer.slab)
                return
        except BaseException:
            if qp is not None:
                qp.destroy()
            raise
        if qp is not None:
            qp.destroy()
            reason = fallback_reason(True, False)
            _say_once(f"peer:{node}", f"event=transport selected=tcp node={node} reason={reason!r}")

    def close(self) -> None:
        if self.device is not None:
            self.device.close()
            self.device = None


async def move(
    conn, op: str, pairs: Sequence[tuple[Any, Any]], counters: Counter[str], node: str
) -> list[bool]:
    """One-sided ``op`` (``"read"`` or ``"write"``) of ``pairs`` over ``conn.verbs``: one
    completion per pair. Any failure (an exception from the transport, a False completion)
    counts the failed pairs in ``rdma_failures``, logs one line and drops the connection's
    queue pair, so its later calls move bytes over TCP. Never raises but for cancellation."""
    t = conn.verbs
    try:
        done = await (t.read(pairs) if op == "read" else t.write(pairs))
        why = "a work request failed"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # pyverbs raises its own types; every one is a miss here
        done, why = [False] * len(pairs), f"{type(exc).__name__}: {exc}"
    failed = done.count(False)
    if failed:
        counters["rdma_failures"] += failed
        conn.drop_verbs()
        log.warning("event=transport_fallback node=%s op=%s failed=%d reason=%r", node, op, failed, why)
    return done


def _open_device(name: str, gid_index: int):  # pragma: no cover - needs a verbs device
    from rdma.verbs import VerbsDevice

    device = VerbsDevice.open(name or None, gid_index=gid_index)
    log.info("event=transport selected=rdma device=%s", device.name)
    return device
