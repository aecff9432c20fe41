"""The NVMe tier: `store.DiskStore` over a cache directory, a face over parts sharing one
`state.DiskState` (reads, writes, the commits, slots, admin); the books in `index/` (SQLite only),
the bytes in `slab/` (files only); group commit, recovery, the directory's safety, the lease."""
