"""The disk store's bytes: slab files, the slot format, open fds, vectored batch I/O (files only:
never imports sqlite3 or `index/`)."""
