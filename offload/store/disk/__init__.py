"""The NVMe tier: `store.DiskStore` over a cache directory; the books in `index/` (SQLite only), the
bytes in `slab/` (files only); writes, group commit, recovery, the directory's safety, the lease."""
