"""The daemon's member role: what a storage node does as one member of a cluster, beside
serving its data port.

- :mod:`kvstore.member.register`: the node's record in etcd, under a lease it keeps alive.
- :mod:`kvstore.member.base`: :class:`~kvstore.member.base.MemberPass`, the lifecycle,
  counters and metrics every background pass shares; :mod:`kvstore.member.passes` runs one
  pass at a time per node, in slices that rest the event loop.
- :mod:`kvstore.member.repair`: anti-entropy repair (every block back to its copies).
- :mod:`kvstore.member.orphans`: the orphan pass (blocks whose parent is stored nowhere).
- :mod:`kvstore.member.peer_sessions`: the passes' sessions to the other members.

Imports go one way: the daemon (kvstore/daemon/member.py composes ``kvstore serve`` for a
member) imports this package; this package imports the client (placement, membership, the
node client its peer sessions are) and the node store it works on, never the daemon; the
client imports neither (tests/test_import_graph.py).
"""
