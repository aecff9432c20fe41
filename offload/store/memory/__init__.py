"""The DRAM tier: `store.MemoryStore` and its preallocated arena (`arena.ReservedArena`)."""
