"""The one interface for moving payload bytes between a local buffer and a remote one.

A *descriptor* names remote bytes: the handle under which the peer holds them (for the
store, a lease or a reservation; this package knows neither), an address, a length and, for
RDMA, the remote key of the registered region.
A transport moves bytes for a batch of ``(local buffer, descriptor)`` pairs and reports one
completion (True/False) per pair; a failed pair is a miss or a dropped write to the caller,
never an exception. Two implementations: :mod:`rdma.tcp` (bytes inline on a framed TCP
channel, in frames the peer's protocol defines and its owner builds; every machine) and
:mod:`rdma.verbs` (one-sided RDMA READ/WRITE with pyverbs).

Everything in this module is device-free and shared by both: descriptor, QP-info and
registered-region encoding, batching of work requests, buffer addresses, the table of local
registrations and the ``auto | tcp | rdma`` selection. It imports nothing of tierkv (``rdma``
sits below ``kvstore``) and nothing outside the standard library, so the system Python that
carries a host's pyverbs can import it too. Values here are immutable and thread-safe;
transports themselves are bound to one event loop.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

TransportName = Literal["tcp", "rdma"]
MODES = ("auto", "tcp", "rdma")


class TransportError(Exception):
    """A transport cannot be selected, set up or used as asked; the message says which input."""


@dataclass(frozen=True, slots=True)
class RemoteDescriptor:
    """Remote bytes: ``length`` bytes at ``addr`` under ``handle`` (the peer's id for them).

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


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory region as a peer sees it: one-sided reads and writes may target
    ``[addr, addr + length)`` with ``rkey``. A node advertises its DRAM slab this way."""

    addr: int
    length: int
    rkey: int

    def to_wire(self) -> list[int]:
        return [self.addr, self.length, self.rkey]

    @classmethod
    def from_wire(cls, obj: Any) -> Region:
        """Parse ``[addr, length, rkey]``; raises TransportError naming the bad value."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 3:
            raise TransportError(f"region must be [addr, length, rkey], got {obj!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in obj):
            raise TransportError(f"region fields must be non-negative integers, got {obj!r}")
        addr, length, rkey = obj
        if addr + length > 2**64 or rkey >= 2**32:
            raise TransportError(f"region [{addr}, {length}, {rkey}] is outside u64 addresses / u32 keys")
        return cls(addr, length, rkey)

    def descriptor(self, handle: int, offset: int, length: int) -> RemoteDescriptor:
        """The descriptor of ``length`` bytes at ``offset`` in this region; TransportError when
        they do not lie inside it."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise TransportError(f"bytes [{offset}, {offset + length}) are outside a region of {self.length}")
        return RemoteDescriptor(handle, self.addr + offset, length, self.rkey)

    def contains(self, desc: RemoteDescriptor) -> bool:
        """True when ``desc`` names bytes inside this region, whatever its key (a node's
        descriptors carry per-lease window keys, not the region's own: rdma/windows.py)."""
        return self.addr <= desc.addr and desc.addr + desc.length <= self.addr + self.length

    def holds(self, desc: RemoteDescriptor) -> bool:
        """True when ``desc`` names bytes inside this region, under its key."""
        return (
            desc.rkey == self.rkey
            and self.addr <= desc.addr
            and desc.addr + desc.length <= self.addr + self.length
        )


def buffer_address(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a writable contiguous buffer (numpy array, bytearray,
    memoryview, mmap, torch tensor). Raises TransportError for a read-only or strided buffer."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch, without importing it
        if not buf.is_contiguous():
            raise TransportError("cannot register a non-contiguous tensor")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    mv = memoryview(buf)
    if mv.readonly or not mv.contiguous:
        raise TransportError("can only register writable contiguous buffers")
    mv = mv.cast("B")
    if mv.nbytes == 0:
        return 0, 0
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes


class Registrations:
    """The local buffers registered with one device, and their local keys: ``find`` says which
    registration holds a buffer (a work request needs its key). Not thread-safe."""

    def __init__(self) -> None:
        self._items: list[tuple[int, int, int]] = []  # (addr, nbytes, lkey)

    def add(self, addr: int, nbytes: int, lkey: int) -> None:
        self._items.append((addr, nbytes, lkey))

    def find(self, buf: Any) -> int | None:
        """The local key of the registration holding all of ``buf``; None when no single one
        does, or when ``buf`` is read-only or strided (its address cannot be taken)."""
        try:
            addr, n = buffer_address(buf)
        except (TransportError, TypeError, ValueError):
            return None
        for base, size, lkey in self._items:
            if base <= addr and addr + n <= base + size:
                return lkey
        return None

    def covers(self, bufs: Sequence[Any]) -> bool:
        """True when every buffer lies inside a registration (and so can take part in RDMA)."""
        return all(self.find(b) is not None for b in bufs)

    def clear(self) -> None:
        self._items.clear()


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


def select_transport(
    mode: str, local_device: bool, peer_device: bool, key: str = "server.transport"
) -> TransportName:
    """Pick the transport for one connection. ``auto``: RDMA when both sides have a verbs
    device, else TCP; ``tcp``: TCP; ``rdma``: RDMA, and a TransportError when this side has no
    device (raised at start, so a misconfigured node fails loudly) or the peer has none. ``key``
    is the setting the messages name (``server.transport`` for a node, ``transport`` for a
    client). The one selection function: daemon and client both decide through it."""
    if mode not in MODES:
        raise TransportError(f"{key}: expected one of {list(MODES)}, got {mode!r}")
    if mode == "tcp":
        return "tcp"
    if mode == "rdma":
        if not local_device:
            raise TransportError(f"{key} is 'rdma' but this host has no RDMA device")
        if not peer_device:
            raise TransportError(f"{key} is 'rdma' but the peer offered no RDMA device")
        return "rdma"
    return "rdma" if (local_device and peer_device) else "tcp"


def fallback_reason(local_device: bool, peer_device: bool) -> str:
    """Why ``auto`` chose TCP: the text of its one log line."""
    return "no RDMA device on this host" if not local_device else "the peer offered no RDMA"


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

    def destroy(self) -> None:  # noqa: B027 - optional hook
        """Release what the transport holds, synchronously (for owners that cannot await, such
        as a connection being closed); idempotent."""

    async def close(self) -> None:
        """Release what the transport holds; idempotent."""
        self.destroy()
