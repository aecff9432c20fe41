"""The disk store's books: the SQLite index (never touches block bytes, never imports `slab/`)."""
