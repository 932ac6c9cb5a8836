"""The storage node: NodeStore (kvstore/node/store.py) over its tiers (kvstore/node/tiers/),
leases and reservations, eviction and inspection. Nothing heavy is imported here."""
