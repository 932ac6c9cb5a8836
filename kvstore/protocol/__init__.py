"""The data-port protocol: operations, versioning, limits, and one typed message per frame.

A frame is ``[u32 header length][msgpack map][raw payload]`` (framing and ``plen`` live in
:mod:`rdma.framing`, the zero-copy socket I/O in :mod:`rdma.channel`); this package says
what the maps contain, and is the only place that names their fields: fields.py (limits, error codes, field parsers),
hello.py, records.py (per-key results), requests.py and replies.py; everything is re-exported
here, so users write ``from kvstore import protocol as P``. Each op has a request and a reply dataclass (frozen):
``to_wire()`` gives the map to send, ``from_wire(map)`` validates every field and raises
:class:`ProtocolError` naming the bad one (``bad_request``; ``unknown_op``/``bad_version``
where the code says so). Every request carries ``rid`` (echoed in its reply); a failed reply
is an :class:`ErrorReply`. Per-key results are byte columns (EXISTS, DELETE, PUT/COMMIT and
GET: one byte per key each, a GET's headers one buffer with offsets) or named records
(:class:`LeaseEntry`, :class:`ReserveEntry`), sent as short positional lists. docs/protocol.md specifies every frame. Nothing here touches a
socket; everything is immutable and thread-safe.
"""

from kvstore.protocol.fields import (  # noqa: F401
    AUTH,
    BAD_FRAME,
    BAD_REQUEST,
    BAD_VERSION,
    BUSY,
    FATAL_CODES,
    INTERNAL,
    MAX_BATCH,
    MAX_BLOCKS,
    MAX_EXISTS_KEYS,
    MAX_HEADER,
    MAX_REPLY_HEADER,
    PROTOCOL_VERSION,
    TOO_LARGE,
    TRANSPORT,
    UNKNOWN_OP,
    ProtocolError,
    bad,
    req_headers,
    request_rid,
)
from kvstore.protocol.hello import (  # noqa: F401
    ErrorReply,
    Hello,
    HelloReply,
    RdmaReply,
    check_reply,
    namespace_from_wire,
    namespace_to_wire,
)
from kvstore.protocol.records import (  # noqa: F401
    PUT_TIERS,
    LeaseEntry,
    ReserveEntry,
    put_results_from_wire,
    put_results_to_wire,
)
from kvstore.protocol.replies import (  # noqa: F401
    CommitReply,
    DeleteReply,
    ExistsReply,
    GetReply,
    LeaseReply,
    PutReply,
    ReadReply,
    ReleaseReply,
    ReserveReply,
    StatsReply,
    WriteReply,
)
from kvstore.protocol.requests import (  # noqa: F401
    OPS,
    PAYLOAD_OPS,
    REQUESTS,
    CommitRequest,
    DeleteRequest,
    ExistsRequest,
    GetRequest,
    LeaseRequest,
    PutRequest,
    ReadRequest,
    ReleaseRequest,
    ReserveRequest,
    StatsRequest,
    WriteRequest,
    req_op,
)
