"""The daemon's side of RDMA: the verbs device, the DRAM slab registered once, a queue pair
per connection, and the descriptors that point into the slab.

At start ``server.transport`` is decided (:func:`decide`, through the one selection function
:func:`rdma.transport.select_transport`) and :func:`start_rdma` logs exactly one
``event=transport`` line:
``tcp`` never opens a device; ``auto`` opens the device and registers the slab when the host
has one and the node has a DRAM tier, else it serves TCP only and the line says why; ``rdma``
without a device (or without a DRAM tier, or when the device fails) is a ConfigError naming
the key, before anything is served. Per connection (:meth:`SlabRdma.accept`), a client's QP
offer in HELLO gets a new QP connected to it and the reply's ``rdma`` map.

:func:`slab_descriptor` is device-free: the RDMA address of a lease's or reservation's bytes
is the slab's registered base plus the slot's offset in the DRAM arena. The slab is registered
without remote access: a peer reaches a slot only through the memory window the daemon binds
to it per lease (rdma/windows.py, kvstore/daemon/descriptor_ops.py). Loop thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore.daemon.logs import kv
from kvstore.errors import ConfigError
from kvstore.protocol import RdmaReply
from rdma.transport import QPInfo, Region, RemoteDescriptor, TransportError, fallback_reason, select_transport

log = logging.getLogger("kvstore.daemon")


def slab_descriptor(slab: Region, handle: int, held: Any) -> RemoteDescriptor | None:
    """The RDMA descriptor of a Lease's or Reservation's payload when it sits in the registered
    DRAM slab (``held.offset`` is its place in the DRAM arena); None when it does not (a private
    copy of a disk block, a GPU slot): those move inline (GET/PUT) instead."""
    if held.offset is None or held.tier != "dram":
        return None
    return slab.descriptor(handle, held.offset, held.header.payload_len)


class SlabRdma:
    """An open verbs device with the node's DRAM slab registered on it."""

    def __init__(self, device, slab: Region) -> None:
        self.device = device
        self.slab = slab

    def accept(self, offer: QPInfo) -> tuple[Any, RdmaReply]:
        """A new queue pair connected to the client's ``offer``, and the HELLO reply's ``rdma``.
        TransportError when the device refuses (the caller decides: TCP or a refusal)."""
        qp = self.device.queue_pair()
        try:
            qp.connect(offer)
        except BaseException:
            qp.destroy()
            raise
        return qp, RdmaReply(qp.info, self.slab)

    def close(self) -> None:
        self.device.close()


def accept_offer(
    rdma: SlabRdma | None, mode: str, offer: QPInfo | None, peer: str, metrics
) -> tuple[Any, RdmaReply] | None:
    """HELLO's RDMA half, through the one selection function: ``(queue pair, reply's rdma)``
    when this connection moves bytes one-sidedly; None when they move inline (the node serves
    TCP only, or the client offered no queue pair under ``auto``, or the device could not
    connect it under ``auto``: logged and counted). TransportError under ``server.transport =
    "rdma"`` for a client without RDMA or a device failure: the caller refuses the connection."""
    try:
        if select_transport(mode, rdma is not None, offer is not None) == "tcp":
            return None
        return rdma.accept(offer)
    except TransportError as exc:
        if mode == "rdma":
            raise
        metrics.rdma_accept_failures.inc()
        log.warning(kv("rdma_accept_failed", peer=peer, error=exc))
        return None


def decide(server_cfg, has_device: bool) -> str:
    """``server.transport`` for this node (``"tcp"`` or ``"rdma"``), through the one selection
    function; ConfigError naming the key for ``rdma`` without a device. Call it before binding
    anything, so a misconfigured node fails at once."""
    try:
        return select_transport(server_cfg.transport, has_device, True)
    except TransportError as exc:
        raise ConfigError(str(exc)) from exc


def start_rdma(server_cfg, chosen: str, slab) -> SlabRdma | None:
    """For ``chosen == "rdma"``: open the device and register ``slab`` (the DRAM arena's buffer,
    or None without a DRAM tier). Logs the one ``event=transport`` line. Returns None when the
    node serves TCP only; ConfigError when ``server.transport = "rdma"`` cannot be honoured."""
    mode = server_cfg.transport
    if chosen == "tcp":
        reason = "server.transport is tcp" if mode == "tcp" else fallback_reason(False, True)
        log.info(kv("transport", selected="tcp", reason=reason))
        return None
    try:
        if slab is None:
            raise TransportError("no DRAM tier to register (dram.capacity is 0)")
        return _open(server_cfg, slab)
    except TransportError as exc:
        if mode == "rdma":
            raise ConfigError(f"server.transport is 'rdma' but RDMA cannot start: {exc}") from exc
        log.info(kv("transport", selected="tcp", reason=f"RDMA device unusable: {exc}"))
        return None


def _open(server_cfg, slab) -> SlabRdma:  # pragma: no cover - needs a verbs device
    from rdma.verbs import VerbsDevice

    device = VerbsDevice.open(server_cfg.rdma_device or None, gid_index=server_cfg.rdma_gid_index)
    try:
        region = device.register(slab, remote=False)  # reached only through per-lease windows
    except BaseException:
        device.close()
        raise
    log.info(
        kv(
            "transport",
            selected="rdma",
            device=device.name,
            slab_bytes=region.length,
            clients_without_rdma="tcp" if server_cfg.transport == "auto" else "refused",
        )
    )
    return SlabRdma(device, region)
