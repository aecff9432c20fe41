"""Pages as KV-event rows, and rows as SGLang's own event objects.

A `Row` is one L3 page: its block key (the store's 32-byte key of the page's first object), the
block hash SGLang publishes for the page, and the hash of the page before it (None at the start
of a sequence). SGLang's radix tree publishes `hash_str_to_int64(page_hash)` for a page whose
request has no LoRA extra key or cache salt, where `page_hash` is the same hex string the HiCache
storage backend is given as the page's key (`hash_value` of the radix node). So a backend knows
the hash of every page it stores, and the parent from SGLang's `prefix_keys` (with
`hicache_storage_pass_prefix_keys`, which `launch` sets when KV events are on).

`events(changes, page_size)` turns (medium, op, row) triples into SGLang's `BlockStored` /
`BlockRemoved` (`sglang.srt.disaggregation.kv_events`, imported when first needed), merging a
run of stores of one chain into one event as SGLang's own recorder does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

STORED = "S"
REMOVED = "R"


class Row(NamedTuple):
    key: bytes            # the store's block key (first object of the page)
    hash: int             # the block hash of SGLang's events
    parent: int | None    # the hash of the page before, None at a sequence start


def event_hash(page_key: str) -> int:
    """SGLang's event hash of a page key (its `hash_str_to_int64`: the first 64 bits, signed)."""
    u = int(page_key[:16], 16)
    return u - (1 << 64) if u >= (1 << 63) else u


def page_rows(keys: Sequence[str], bkeys: Sequence[bytes], ok: Sequence[bool],
              prefix_keys: Sequence[str] | None, split: int = 1) -> list[Row]:
    """Rows of the pages of one backup call that were stored (`ok`), in chain order. `bkeys`:
    the block keys, `split` per page (only the first names the page here)."""
    rows: list[Row] = []
    parent = event_hash(prefix_keys[-1]) if prefix_keys else None
    for i, key in enumerate(keys):
        h = event_hash(key)
        if i < len(ok) and ok[i] and i * split < len(bkeys):
            rows.append(Row(bytes(bkeys[i * split]), h, parent))
        parent = h
    return rows


def events(changes: Sequence[tuple[str, str, Row]], page_size: int) -> list[Any]:
    """SGLang event objects for (medium, op, row) changes, in order; consecutive stores of one
    chain and consecutive removals of one medium become one event."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

    out: list[Any] = []
    for medium, op, row in changes:
        tail = out[-1] if out else None
        if op == REMOVED:
            if isinstance(tail, BlockRemoved) and tail.medium == medium:
                tail.block_hashes.append(row.hash)
            else:
                out.append(BlockRemoved(block_hashes=[row.hash], medium=medium))
            continue
        if (isinstance(tail, BlockStored) and tail.medium == medium
                and tail.block_hashes[-1] == row.parent and row.parent is not None):
            tail.block_hashes.append(row.hash)
            continue
        out.append(BlockStored(block_hashes=[row.hash], parent_block_hash=row.parent,
                               token_ids=[], block_size=page_size, lora_id=None, medium=medium))
    return out
