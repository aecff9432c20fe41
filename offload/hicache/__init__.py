"""What SGLang loads: the HiCache L3 backend and what it needs.

`backend` (`OffloadStorage`, SGLang's `HiCacheStorage` over a block store: a face over parts
sharing one `state.BackendState`): the parts `attach` (host pools registered), `kv` (KV pages,
zero copy), `sidecars` (the v2 calls: draft, indexer, Mamba, SWA, DeepSeek-V4 pools), `legacy`
(the copying interface) and `recorder` (the metrics of every move); `pools` (`Pool`: one host
pool, KV or sidecar), `page_io` (`move`: a pool's pages <-> the store), `keying` (which blocks
hold a rank's pages: namespaces, head groups, writers), `layout` (host-pool page -> buffers),
`settings` (the extra config), `events` (L3 KV events), `l3_layout` (SGLang's L3 layout
handshake), `worth_it` (load-or-recompute rule), `native_hash` (SGLang's page-hash extension,
built before the first request), `contract` (backend name, module, class and extra-config keys;
imports no SGLang). `offload.hicache:OffloadStorage` is the name users' configs, `launch` and
patches/ give SGLang: it resolves lazily, so importing `offload.hicache.contract` does not import
SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OffloadStorage"]


def __getattr__(name: str) -> Any:
    if name == "OffloadStorage":
        from offload.hicache.backend import OffloadStorage

        return OffloadStorage
    raise AttributeError(f"module 'offload.hicache' has no attribute {name!r}")
