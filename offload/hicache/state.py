"""What the parts of one `OffloadStorage` share: `BackendState`.

`OffloadStorage` (`backend.py`) is a face over parts — `Attach` (`attach.py`: the host pools),
`KvPages` (`kv.py`: `batch_exists`, `batch_get_v1`, `batch_set_v1`), `PoolPages`
(`sidecars.py`: the v2 calls), `Legacy` (`legacy.py`: the copying calls) and the `Recorder`
(`recorder.py`: the metrics of every move) — each a plain class handed this one object.

The state holds: the settings (`cfg`, SGLang's `storage_config`), the block store, whether this
rank is the KV storage writer, the worth-it rule, the Prometheus metrics (`tm`, None when
`offload.metrics.enabled` is false) and the transfer path they are labelled with, and what the
attach fixed: the KV host pool, the KV namespace, the KV `Pool` (its page map, key plan and
writer; None before the attach and under DeepSeek-V4's logical anchor, whose pages live in the
sidecars), the sidecar `Pool`s by name, and the L3 KV events (`events.py`).

Threads: SGLang attaches from its scheduler thread, then calls the data path from its storage
threads (prefetch, backup) at once; after the attach only `pools` grows (a run-time sidecar).
`store` and `worth` may be replaced (tests do): parts read them from here on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from offload.config import OffloadConfig
from offload.hicache.pools import Pool
from offload.hicache.worth_it import WorthIt
from offload.keys import Namespace
from offload.metrics import TierMetrics
from offload.store.base import BlockStore

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from offload.events import L3Events


@dataclass(eq=False)
class BackendState:
    cfg: OffloadConfig
    storage_config: "HiCacheStorageConfig"
    store: BlockStore
    is_writer: bool                        # this rank writes KV pages (`keying.storage_writer`)
    worth: WorthIt
    tm: TierMetrics | None                 # our Prometheus metrics (None: turned off)
    transfer_path: str                     # cpu, gds or dpu: the metrics' `path` label
    host: Any = None                       # SGLang's KV host pool (the anchor)
    namespace: Namespace | None = None     # the KV namespace (a logical anchor's too)
    kv: Pool | None = None                 # KV pages (None: not attached, or a logical anchor)
    logical_anchor: bool = False           # DeepSeek-V4: the anchor holds no bytes
    pools: dict[str, Pool] = field(default_factory=dict)    # sidecars by SGLang's pool name
    attached: bool = False                 # SGLang's registration burst is over
    events: "L3Events | None" = None

    def kv_keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """The KV block keys of SGLang's page hashes (none before the attach)."""
        return self.kv.keys(page_hashes) if self.kv is not None else []

    @property
    def kv_split(self) -> int:
        """KV objects per page (head groups), 1 before the attach."""
        return self.kv.split if self.kv is not None else 1

    def namespace_digests(self) -> list[bytes]:
        """Every namespace this rank's blocks live in: the KV objects and every sidecar pool."""
        kv = self.kv.plan.digests if self.kv is not None else []
        return kv + [p.digest for p in self.pools.values()]
