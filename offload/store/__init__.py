"""Where blocks live: bytes in, bytes out; no GPU code.

`base.BlockStore` is the one interface; `disk.DiskStore` (slab files + crash-safe index),
`memory.MemoryStore` (DRAM tier and test fake) and `redis.RedisStore` implement it.
"""
