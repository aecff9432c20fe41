"""Where each page of an SGLang host KV pool lives in memory: page index -> list of buffers.

Primitive: `PageMap.for_pool(host_pool)`, then `PageMap.buffers(token_index)` gives the writable
memoryviews whose concatenation is one page, in exactly the byte order of SGLang's own
`host_pool.get_data_page(index, flat=True)` (so a block written through the zero-copy path and one
written through the legacy flat-page path are the same bytes). No bytes are copied:

- `page_first` / `page_first_direct` (MHA): 2 buffers per page (the page's K half and V half);
  MLA: 1 buffer per page.
- `layer_first`: one slice per layer (and per K/V for MHA): vectored I/O.

Decode context parallel (`dcp_size` > 1): SGLang addresses the host pool in LOGICAL token indices
(`dcp_size` logical slots share a physical row), so a page starts every `index_step` =
page_size x dcp_size logical indices; this rank's share of it is the physical page.

The map is computed once from `get_data_page(..., flat=False)` views (strides decomposed into
contiguous runs), checked to be affine in the page number, then each call only adds a page offset.
A pool whose pages are not views of one contiguous CPU tensor gets `zero_copy == False`; the backend
then goes through SGLang's flat-page copy helpers instead (same bytes, one copy).

torch is imported here only by the caller having built a host pool; this module imports it lazily.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

Chunk = tuple[int, int]  # (byte offset from the start of the base buffer, length in bytes)


def _contiguous_runs(view: Any, base_ptr: int) -> list[Chunk]:
    """Decompose a strided tensor view into contiguous byte runs, in row-major order."""
    item = view.element_size()
    dims = [(s, st) for s, st in zip(view.shape, view.stride()) if s != 1]
    start = view.data_ptr() - base_ptr
    # Largest contiguous suffix of dims (in elements).
    run = 1
    k = len(dims)
    while k > 0 and dims[k - 1][1] == run:
        run *= dims[k - 1][0]
        k -= 1
    outer = dims[:k]
    chunks: list[Chunk] = []
    idx = [0] * len(outer)
    total = 1
    for s, _ in outer:
        total *= s
    for _ in range(total):
        off = start + sum(i * st for i, (_, st) in zip(idx, outer)) * item
        if chunks and chunks[-1][0] + chunks[-1][1] == off:
            chunks[-1] = (chunks[-1][0], chunks[-1][1] + run * item)
        else:
            chunks.append((off, run * item))
        for d in range(len(outer) - 1, -1, -1):
            idx[d] += 1
            if idx[d] < outer[d][0]:
                break
            idx[d] = 0
    return chunks


@dataclass
class PageMap:
    """Page layout of one host pool (see the module docstring)."""

    layout: str
    page_size: int          # tokens per page
    page_num: int           # pages in the pool
    page_bytes: int
    zero_copy: bool
    template: list[Chunk]   # chunks of page 0
    page_stride: int        # bytes between page p and page p+1 (same for every chunk)
    dcp_size: int = 1       # logical host indices per physical token (decode context parallel)
    _base: memoryview | None = None
    _pool: Any = None

    @classmethod
    def for_pool(cls, host_pool: Any) -> "PageMap":
        import torch

        page_size = int(host_pool.page_size)
        layout = str(host_pool.layout)
        size = int(host_pool.size)
        page_num = size // page_size
        dcp = int(getattr(host_pool, "dcp_size", 1) or 1)
        step = page_size * dcp
        base = getattr(host_pool, "kv_buffer", None)
        page0 = host_pool.get_data_page(0, flat=False)
        page_bytes = page0.numel() * page0.element_size()
        plain = dict(layout=layout, page_size=page_size, page_num=page_num, dcp_size=dcp,
                     page_bytes=page_bytes, template=[], page_stride=0, _pool=host_pool)
        if not (isinstance(base, torch.Tensor) and base.device.type == "cpu"
                and base.is_contiguous()):
            logger.info("offload: host pool %s (%s) is not one contiguous CPU tensor; pages "
                        "are copied through SGLang's flat-page helpers", type(host_pool).__name__,
                        layout)
            return cls(zero_copy=False, **plain)
        base_ptr = base.data_ptr()
        base_len = base.numel() * base.element_size()
        t0 = _contiguous_runs(page0, base_ptr)
        ok = page_num >= 2
        stride = 0
        if ok:
            t1 = _contiguous_runs(host_pool.get_data_page(step, flat=False), base_ptr)
            last = (page_num - 1) * step
            tl = _contiguous_runs(host_pool.get_data_page(last, flat=False), base_ptr)
            stride = t1[0][0] - t0[0][0]
            ok = (len(t0) == len(t1) == len(tl)
                  and all(b == (o + stride, n) for (o, n), b in zip(t0, t1))
                  and all(b == (o + stride * (page_num - 1), n) for (o, n), b in zip(t0, tl))
                  and all(0 <= o and o + n <= base_len for o, n in t0 + tl)
                  and sum(n for _, n in t0) == page_bytes)
        if not ok:
            logger.info("offload: host pool %s (%s) pages are not evenly spaced; pages are "
                        "copied through SGLang's flat-page helpers", type(host_pool).__name__,
                        layout)
            return cls(zero_copy=False, **plain)
        flat = base.detach().reshape(-1).view(torch.uint8)
        plain.update(template=t0, page_stride=stride)
        return cls(zero_copy=True, _base=flat.numpy().data, **plain)    # a memoryview of the pool

    @property
    def buffers_per_page(self) -> int:
        return len(self.template)

    @property
    def index_step(self) -> int:
        """SGLang's host indices per page (page_size, x dcp_size under decode context parallel)."""
        return self.page_size * self.dcp_size

    def page_no(self, token_index: int) -> int | None:
        """The page number of a page's first token index, or None if it is not one."""
        step = self.index_step
        if token_index % step or not 0 <= token_index < self.page_num * step:
            return None
        return token_index // step

    def buffers(self, token_index: int) -> list[memoryview]:
        """Writable views (zero copy) whose concatenation is the page starting at token_index.

        Only valid when `zero_copy`; the index must be a page's first token (see `page_no`).
        """
        assert self._base is not None  # internal invariant: callers check zero_copy
        shift = (token_index // self.index_step) * self.page_stride
        base = self._base
        return [base[o + shift:o + shift + n] for o, n in self.template]

    def page_copy(self, token_index: int) -> memoryview:
        """A flat copy of one page (non-zero-copy pools): SGLang's own `get_data_page`."""
        import torch

        page = self._pool.get_data_page(token_index, flat=True).contiguous()
        return memoryview(page.view(torch.uint8).numpy())

    def scratch(self) -> tuple[Any, memoryview]:
        """A fresh flat page tensor and a writable view of its bytes (non-zero-copy reads)."""
        import torch

        page = self._pool.get_dummy_flat_data_page().contiguous()
        return page, memoryview(page.view(torch.uint8).numpy())

    def store_copy(self, token_index: int, page: Any) -> None:
        """Put a flat page read into `scratch()` back into the pool."""
        self._pool.set_from_flat_data_page(token_index, page)
