"""SGLang's CPU host<->device KV copies (patch 0005): token rows against whole pages.

    .venv/bin/python scripts/copy_bench.py --tokens 8192 --repeat 7

On the CPU engine a HiCache transfer between the host pool and the device pool is a torch copy
(`sglang/srt/mem_cache/pool_host/torch_transfer.py`). It used to gather and scatter token by token
through two index tensors (page, offset); it now copies whole pages with one `index_select` /
`index_copy_` when both sides' indices are whole pages, as HiCache's are. This times both on one
layer's K (or V) of the given shape, for every host layout, in alternating tries (medians), both
directions, and checks that they write the same bytes. Milliseconds per layer and K or V: an L3
hit of N tokens pays 2 x layers of them each way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sglang.srt.mem_cache.pool_host.torch_transfer import (
    copy_rows_to_device,
    copy_rows_to_host,
    host_layer_pages,
)

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def host_buffer(layout: str, tokens: int, layers: int, heads: int, dim: int, page: int) -> torch.Tensor:
    shape = {"layer_first": (layers, tokens, heads, dim), "page_first": (tokens, layers, heads, dim),
             "page_first_direct": (tokens // page, layers, page, heads, dim),
             "page_head": (tokens // page, heads, page, layers, dim)}[layout]
    return torch.randn(shape).to(torch.bfloat16)


def rows_to_device(pages: torch.Tensor, host_idx: torch.Tensor, dev: torch.Tensor, dev_idx: torch.Tensor):
    """The token-by-token copy patch 0005 used before (and still uses for other indices)."""
    size = pages.shape[1]
    dev[dev_idx] = pages[host_idx // size, host_idx % size]


def rows_to_host(dev: torch.Tensor, dev_idx: torch.Tensor, pages: torch.Tensor, host_idx: torch.Tensor):
    size = pages.shape[1]
    pages[host_idx // size, host_idx % size] = dev[dev_idx]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens moved (whole pages)")
    ap.add_argument("--page", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7, help="alternating tries of each")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    if args.tokens <= 0 or args.tokens % args.page:
        ap.error(f"--tokens {args.tokens}: a positive multiple of --page {args.page}")
    n_pages = args.tokens // args.page
    host_tokens, dev_tokens = 4 * args.tokens, 2 * args.tokens + args.page
    gen = torch.Generator().manual_seed(1)
    host_pages_idx = torch.randperm(host_tokens // args.page, generator=gen)[:n_pages]
    dev_pages_idx = torch.randperm(dev_tokens // args.page - 1, generator=gen)[:n_pages] + 1
    offsets = torch.arange(args.page)
    host_idx = (host_pages_idx[:, None] * args.page + offsets).flatten()
    dev_idx = (dev_pages_idx[:, None] * args.page + offsets).flatten()
    mib = args.tokens * args.heads * args.head_dim * 2 / 2**20
    print(f"{args.tokens} tokens = {n_pages} pages of {args.page}; one layer's K (or V): "
          f"{args.heads} heads x {args.head_dim}, bf16, {mib:.1f} MiB; "
          f"medians of {args.repeat} alternating tries, ms")
    print(f"{'layout':18} {'direction':10} {'rows':>8} {'pages':>8} {'rows/pages':>10}")
    for layout in args.layouts.split(","):
        hbuf = host_buffer(layout, host_tokens, args.layers, args.heads, args.head_dim, args.page)
        pages = host_layer_pages(hbuf, layout, 1, args.page)
        dev = torch.randn(dev_tokens, args.heads, args.head_dim).to(torch.bfloat16)
        for direction in ("to device", "to host"):
            if direction == "to device":
                old = lambda: rows_to_device(pages, host_idx, dev, dev_idx)  # noqa: E731
                new = lambda: copy_rows_to_device(pages, host_idx, dev, dev_idx)  # noqa: E731
            else:
                old = lambda: rows_to_host(dev, dev_idx, pages, host_idx)  # noqa: E731
                new = lambda: copy_rows_to_host(dev, dev_idx, pages, host_idx)  # noqa: E731
            snapshot = (hbuf.clone(), dev.clone())
            old()
            want = (hbuf.clone(), dev.clone())
            hbuf.copy_(snapshot[0]), dev.copy_(snapshot[1])
            new()
            if not (torch.equal(hbuf, want[0]) and torch.equal(dev, want[1])):
                raise SystemExit(f"{layout} {direction}: the page copy wrote other bytes")
            times: dict[str, list[float]] = {"rows": [], "pages": []}
            for _ in range(args.repeat):
                for name, fn in (("rows", old), ("pages", new)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            r, p = (statistics.median(times[k]) * 1e3 for k in ("rows", "pages"))
            print(f"{layout:18} {direction:10} {r:8.2f} {p:8.2f} {r / p:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
