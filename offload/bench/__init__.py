"""Benchmarks: each reports figures beside a baseline measured in the same run (raw disk, stock
SGLang backend, raw Redis, NIXL loopback), as ratios."""
