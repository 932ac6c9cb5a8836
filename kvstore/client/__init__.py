"""Clients of the store: one node (node.py over conn.py, the descriptor path in leased.py and
rdma.py), the replicated cluster (cluster.py with placement, membership, health, reads, writes,
repair) and etcd registration. Nothing heavy is imported here."""
