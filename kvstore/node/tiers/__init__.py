"""Storage tiers: memory (DRAM/HBM over a slab allocator) and disk (LMDB)."""
