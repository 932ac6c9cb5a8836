"""The one interface for moving payload bytes between a local buffer and a remote one.

A *descriptor* names remote bytes: a lease (GET side) or a reservation (PUT side) on the
storage node, an address, a length and, for RDMA, the remote key of the registered region.
A transport moves bytes for a batch of ``(local buffer, descriptor)`` pairs and reports one
completion (True/False) per pair; a failed pair is a miss or a dropped write to the caller,
never an exception. Two implementations: :mod:`rdma.tcp` (bytes inline on the data
connection; every machine) and :mod:`rdma.verbs` (one-sided RDMA READ/WRITE with pyverbs).

Everything in this module is device-free and shared by both: descriptor and QP-info
encoding, batching of work requests, and the ``auto | tcp | rdma`` selection. It imports
nothing of tierkv (``rdma`` sits below ``kvstore``). Values here are immutable and
thread-safe; transports themselves are bound to one event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

TransportName = Literal["tcp", "rdma"]
MODES = ("auto", "tcp", "rdma")


class TransportError(Exception):
    """A transport cannot be selected, set up or used as asked; the message says which input."""


@dataclass(frozen=True, slots=True)
class RemoteDescriptor:
    """Remote bytes: ``length`` bytes at ``addr`` under ``handle`` (a lease or reservation id).

    For TCP ``addr`` is an offset inside the handle's payload and ``rkey`` is 0; for RDMA
    ``addr`` is a virtual address inside the node's registered DRAM slab and ``rkey`` its key.
    """

    handle: int
    addr: int
    length: int
    rkey: int = 0

    def to_wire(self) -> list[int]:
        return [self.handle, self.addr, self.length, self.rkey]

    @classmethod
    def from_wire(cls, obj: Any) -> RemoteDescriptor:
        """Parse ``[handle, addr, length, rkey]``; raises TransportError naming the bad value."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 4:
            raise TransportError(f"descriptor must be [handle, addr, length, rkey], got {obj!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in obj):
            raise TransportError(f"descriptor fields must be u64 integers, got {obj!r}")
        return cls(*obj)


@dataclass(frozen=True, slots=True)
class QPInfo:
    """What two RC queue pairs exchange to connect (over the daemon's TCP connection)."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes  # 16 bytes; all zero on InfiniBand without GRH
    mtu: int  # IBV_MTU enum value (1..5)
    port: int = 1
    gid_index: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "qpn": self.qp_num,
            "psn": self.psn,
            "lid": self.lid,
            "gid": self.gid,
            "mtu": self.mtu,
            "port": self.port,
            "gidx": self.gid_index,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> QPInfo:
        """Parse the map sent in HELLO; raises TransportError naming the bad field."""
        if not isinstance(obj, dict):
            raise TransportError(f"qp info must be a map, got {type(obj).__name__}")
        try:
            info = cls(
                qp_num=obj["qpn"],
                psn=obj["psn"],
                lid=obj["lid"],
                gid=obj["gid"],
                mtu=obj["mtu"],
                port=obj.get("port", 1),
                gid_index=obj.get("gidx", 0),
            )
        except KeyError as exc:
            raise TransportError(f"qp info lacks field {exc.args[0]!r}") from exc
        for name in ("qp_num", "psn", "lid", "mtu", "port", "gid_index"):
            v = getattr(info, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TransportError(f"qp info field {name} must be a non-negative int, got {v!r}")
        if info.qp_num >= 2**24 or info.psn >= 2**24:
            raise TransportError(f"qp info qpn/psn must fit 24 bits, got {info.qp_num}/{info.psn}")
        if not isinstance(info.gid, bytes) or len(info.gid) != 16:
            raise TransportError(f"qp info gid must be 16 bytes, got {info.gid!r}")
        if not 1 <= info.mtu <= 5:
            raise TransportError(f"qp info mtu must be an IBV_MTU value 1..5, got {info.mtu}")
        return info


def batches(
    pairs: Sequence[tuple[Any, RemoteDescriptor]], max_wr: int, max_bytes: int
) -> Iterator[list[int]]:
    """Indices of ``pairs`` cut into batches of at most ``max_wr`` work requests and (unless a
    single pair is larger) ``max_bytes`` bytes, in order. One batch is one doorbell (RDMA) or
    one frame (TCP). Raises TransportError for a non-positive limit."""
    if max_wr <= 0 or max_bytes <= 0:
        raise TransportError(f"batch limits must be positive, got max_wr={max_wr} max_bytes={max_bytes}")
    cur: list[int] = []
    size = 0
    for i, (_, desc) in enumerate(pairs):
        if cur and (len(cur) >= max_wr or size + desc.length > max_bytes):
            yield cur
            cur, size = [], 0
        cur.append(i)
        size += desc.length
    if cur:
        yield cur


def select_transport(mode: str, local_device: bool, peer_device: bool) -> TransportName:
    """Pick the transport for one connection. ``auto``: RDMA when both sides have a verbs
    device, else TCP; ``tcp``: TCP; ``rdma``: RDMA, and a TransportError when this side has no
    device (raised at start, so a misconfigured node fails loudly) or the peer has none."""
    if mode not in MODES:
        raise TransportError(f"server.transport: expected one of {list(MODES)}, got {mode!r}")
    if mode == "tcp":
        return "tcp"
    if mode == "rdma":
        if not local_device:
            raise TransportError("server.transport is 'rdma' but this host has no RDMA device")
        if not peer_device:
            raise TransportError("server.transport is 'rdma' but the peer offered no RDMA device")
        return "rdma"
    return "rdma" if (local_device and peer_device) else "tcp"


def check_pairs(pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[memoryview]:
    """Byte views of the local buffers; raises TransportError when one is shorter than its
    descriptor (a caller bug, named by index)."""
    views = []
    for i, (buf, desc) in enumerate(pairs):
        mv = memoryview(buf).cast("B")
        if mv.nbytes < desc.length:
            raise TransportError(f"pair {i}: local buffer of {mv.nbytes} bytes < remote length {desc.length}")
        views.append(mv[: desc.length])
    return views


class Transport(abc.ABC):
    """Batched one-sided byte movement. Not thread-safe: use from one event loop.

    ``read`` fills each local buffer from its descriptor; ``write`` sends each local buffer to
    its descriptor. Both return one completion per pair (True: all bytes moved) and raise only
    for caller bugs (TransportError: buffer shorter than the descriptor); a broken connection
    or a failed work request is False for the pairs it touched.
    """

    name: TransportName

    def register(self, buf) -> Any:
        """Make ``buf`` usable as a local buffer (RDMA: a memory region; TCP: nothing).
        Register large buffers once, not per transfer."""
        return None

    @abc.abstractmethod
    async def read(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]: ...

    @abc.abstractmethod
    async def write(self, pairs: Sequence[tuple[Any, RemoteDescriptor]]) -> list[bool]: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the transport holds; idempotent."""
