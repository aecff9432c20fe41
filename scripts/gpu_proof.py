"""The headline on one GPU: prefill a long prompt, or load its KV bytes from the block store?

    python scripts/gpu_proof.py --out DIR [--tokens 32768,65536,131072] [--cache-dir DIR]
    python scripts/gpu_proof.py --out DIR --dry-run      # a tiny model on the CPU, no GPU parts

Steps (run by scripts/gpu-proof.sh after the `gpu` tests):
  build_model()   a Llama-3.1-8B-shaped decoder from its config, random weights (no download):
                  32 layers, hidden 4096, 32 heads, 8 KV heads, SwiGLU 14336, bf16, torch SDPA
                  (flash / memory-efficient kernels only: a math fallback would need T^2 memory)
  prefill()       time one forward pass over each prompt length; the longest one's K and V of every
                  layer are kept, page by page (64 tokens: SGLang's page_first layout)
  populate()      those pages into the block store (offload.store.disk.store.DiskStore) on local disk
                  through the cpu path, then fsync'ed and dropped from the page cache
  load_cpu()      each prompt's pages back into GPU memory through cpu staging (pinned host
                  buffers, O_DIRECT reads): offload.transfer.cpu_staging.CpuStagingPath
  load_gds()      the same through offload.transfer.gds.GdsPath (kvikio, compat mode OFF). If cuFile
                  refuses the files (no nvidia-fs here), the pages are read again by kvikio in compat
                  mode (POSIX reads through kvikio's bounce buffers) and reported as such, never as GDS
  write_plot()    matplotlib if present, else a minimal PNG of bars (no text; the JSON has figures)
Every load is checked byte for byte against the prefill's pages. Writes gpu-proof.json and
gpu-proof.png to --out.

    python scripts/gpu_proof.py --fp8-summary BF16.json FP8.json --tokens 131008

prints two `bench serve --json` results (gpu-proof.sh: the deployment's own KV dtype and
`--kv-cache-dtype fp8_e4m3`) side by side at one length: the L3's bytes per block, cold and L3
hit times to first token, and whether each L3 hit gave its own cold output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PAGE_TOKENS = 64


@dataclass(frozen=True)
class ModelShape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


LLAMA_8B = ModelShape()
TINY = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1000)


def build_model(shape: ModelShape, device: str, dtype: Any) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            s = shape
            self.ln1, self.ln2 = nn.RMSNorm(s.hidden, eps=1e-5), nn.RMSNorm(s.hidden, eps=1e-5)
            self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
            self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
            self.gate_up = nn.Linear(s.hidden, 2 * s.intermediate, bias=False)
            self.down = nn.Linear(s.intermediate, s.hidden, bias=False)

        def forward(self, x: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
            s, t = shape, x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            q, k = rope(q.view(t, s.heads, s.head_dim), cos, sin), rope(
                k.view(t, s.kv_heads, s.head_dim), cos, sin)
            v = v.view(t, s.kv_heads, s.head_dim)
            rep = s.heads // s.kv_heads
            qh = q.transpose(0, 1)[None]
            kh = k.repeat_interleave(rep, 1).transpose(0, 1)[None]
            vh = v.repeat_interleave(rep, 1).transpose(0, 1)[None]
            a = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            x = x + self.o(a[0].transpose(0, 1).reshape(t, s.heads * s.head_dim))
            g, u = self.gate_up(self.ln2(x)).chunk(2, -1)
            return x + self.down(F.silu(g) * u), k, v

    def rope(x: Any, cos: Any, sin: Any) -> Any:
        x1, x2 = x.float().chunk(2, -1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(shape.vocab, shape.hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(shape.layers))
            self.norm = nn.RMSNorm(shape.hidden, eps=1e-5)
            self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

        def forward(self, ids: Any, kv_out: Any | None = None) -> Any:
            t = ids.shape[0]
            inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, device=ids.device,
                                                            dtype=torch.float32) / shape.head_dim))
            ang = torch.outer(torch.arange(t, device=ids.device, dtype=torch.float32), inv)
            cos, sin = ang.cos(), ang.sin()
            x = self.embed(ids)
            for n, layer in enumerate(self.layers):
                x, k, v = layer(x, cos, sin)
                if kv_out is not None:              # [T, layers, 2, kv_heads, head_dim]
                    kv_out[:, n, 0].copy_(k)
                    kv_out[:, n, 1].copy_(v)
            return self.head(self.norm(x[-1:]))     # the next token's logits only

    with torch.device(device):
        model = Model().to(dtype)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def prefill(model: Any, shape: ModelShape, tokens: list[int], device: str, dtype: Any
            ) -> tuple[dict[int, float], Any]:
    """{tokens: seconds} of one forward pass each, and the longest prompt's KV pages (uint8)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if device == "cuda"
                else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
    times: dict[int, float] = {}
    longest = max(tokens)
    kv = torch.empty((longest, shape.layers, 2, shape.kv_heads, shape.head_dim), dtype=dtype,
                     device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode(), sdpa_kernel(backends):
        model(torch.randint(0, shape.vocab, (PAGE_TOKENS * 16,), device=device, generator=gen))
        for t in sorted(tokens):
            ids = torch.randint(0, shape.vocab, (t,), device=device, generator=gen)
            sync(device)
            t0 = time.perf_counter()
            model(ids, kv if t == longest else None)
            sync(device)
            times[t] = time.perf_counter() - t0
    pages = kv.view(longest // PAGE_TOKENS, -1).view(torch.uint8)
    return times, pages


def drop_page_cache(directory: str) -> None:
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dest(t: Any) -> Any:
    return t if t.is_cuda else t.numpy()


def _keys(n: int) -> list[bytes]:
    return [b"gpu-proof:" + i.to_bytes(22, "big") for i in range(n)]


def populate(path: Any, pages: Any, chunk: int = 128) -> None:
    keys = _keys(pages.shape[0])
    for i in range(0, len(keys), chunk):
        ok = path.put_many(keys[i:i + chunk], [[_dest(pages[j])] for j in range(i, min(
            i + chunk, len(keys)))])
        if not all(ok):
            raise RuntimeError(f"storing pages {i}..{i + chunk}: {ok.count(False)} failed")


def load(path: Any, pages: Any, n: int, device: str, store_dir: str) -> float:
    """Seconds to bring the first n pages from the store into (GPU) memory; checked after."""
    import torch

    drop_page_cache(store_dir)
    dest = torch.empty((n, pages.shape[1]), dtype=torch.uint8, device=device)
    sync(device)
    t0 = time.perf_counter()
    ok = path.get_many(_keys(n), [[_dest(dest[i])] for i in range(n)])
    sync(device)
    took = time.perf_counter() - t0
    if not all(ok) or not torch.equal(dest, pages[:n]):
        raise RuntimeError(f"{type(path).__name__}: {ok.count(False)} of {n} pages missing or "
                           "different after the load")
    return took


def load_kvikio_compat(store: Any, pages: Any, n: int, store_dir: str) -> float:
    """kvikio in compat mode (POSIX reads through its bounce buffers into GPU memory)."""
    import kvikio
    import kvikio.defaults
    import torch

    kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON)
    drop_page_cache(store_dir)
    slots = store.pin_slots(_keys(n))
    dest = torch.empty((n, pages.shape[1]), dtype=torch.uint8, device="cuda")
    files: dict[str, Any] = {}
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        futures = []
        for i, s in enumerate(slots):
            f = files.get(s.path) or files.setdefault(s.path, kvikio.CuFile(s.path, "r"))
            futures.append(f.pread(dest[i], s.length, s.offset))
        for fu in futures:
            fu.get()
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
    finally:
        for f in files.values():
            f.close()
        store.unpin_slots(slots)
    if not torch.equal(dest, pages[:n]):
        raise RuntimeError("kvikio compat mode: pages differ after the load")
    return took


def gds_facts() -> dict[str, Any]:
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except ImportError as e:
        return {"kvikio": None, "why": f"kvikio does not import: {e}"}
    out: dict[str, Any] = {"kvikio": kvikio.__version__,
                           "compat_mode_default": str(kvikio.defaults.get("compat_mode"))}
    try:
        out["is_gds_available"] = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as e:  # noqa: BLE001 - a report, not a decision
        out["is_gds_available"] = None
        out["why"] = str(e)
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        info["nvidia_smi"] = r.stdout.strip()
    return info


def write_plot(result: dict[str, Any], out: Path) -> str:
    rows = result["results"]
    series = [("prefill_s", "prefill"), ("cpu_staging_s", "cpu staging"), ("gds_s", "gds")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _png_bars(rows, series, out) + " (matplotlib absent: bars only, no text)"
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for j, (key, label) in enumerate(series):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0 for r in rows], width, label=label)
    ax.set_xticks([i + width for i in range(len(rows))], [f"{r['tokens'] // 1024}K" for r in rows])
    ax.set_ylabel("seconds")
    ax.set_title(f"{result['model']['name']}: prefill vs loading the KV bytes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return "matplotlib"


def _png_bars(rows: list[dict], series: list[tuple[str, str]], out: Path) -> str:
    """A bar chart as a PNG with no library: prefill grey, cpu staging blue, gds green."""
    w, h, colours = 480, 240, [(128, 128, 128), (40, 90, 200), (40, 160, 70)]
    img = [[(255, 255, 255)] * w for _ in range(h)]
    top = max([r.get(k) or 0 for r in rows for k, _ in series] + [1e-9])
    group = w // max(len(rows), 1)
    bar = group // (len(series) + 1)
    for i, r in enumerate(rows):
        for j, (key, _) in enumerate(series):
            height = int((h - 10) * (r.get(key) or 0) / top)
            x0 = i * group + j * bar + bar // 2
            for y in range(h - height, h):
                for x in range(x0, min(x0 + bar - 2, w)):
                    img[y][x] = colours[j]
    raw = b"".join(b"\0" + bytes(c for px in line for c in px) for line in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    out.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "minimal PNG writer"


def run(out: Path, tokens: list[int], cache_dir: str, dry_run: bool) -> dict[str, Any]:
    import torch

    from offload.config import Size, StoreConfig
    from offload.store.disk.store import DiskStore
    from offload.transfer.cpu_staging import CpuStagingPath

    notes: list[str] = []
    device = "cuda" if not dry_run else "cpu"
    if dry_run:
        shape, dtype, name = TINY, torch.bfloat16, "tiny Llama-shaped model (dry run, CPU)"
        tokens = [PAGE_TOKENS * 4, PAGE_TOKENS * 8, PAGE_TOKENS * 16]
        notes.append("dry run: a tiny model on the CPU; the GPU parts (pinned staging into GPU "
                     "memory, gds) are skipped")
    else:
        shape, dtype, name = LLAMA_8B, torch.bfloat16, "Llama-3.1-8B-shaped (random weights)"
    per_token = shape.kv_bytes_per_token(2)
    need = max(tokens) * per_token
    free = shutil.disk_usage(Path(cache_dir).parent if not Path(cache_dir).exists()
                             else cache_dir).free
    if need * 1.1 > free and not dry_run:
        raise SystemExit(f"gpu_proof: {cache_dir} has {free >> 30} GiB free; the {max(tokens)} "
                         f"token prompt needs {need >> 30} GiB: pass --cache-dir or --tokens")
    t0 = time.perf_counter()
    model = build_model(shape, device, dtype)
    notes.append(f"model built in {time.perf_counter() - t0:.1f} s")
    times, pages = prefill(model, shape, tokens, device, dtype)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(cache_dir, ignore_errors=True)
    store = DiskStore(StoreConfig(path=cache_dir, capacity=Size(int(need * 1.25) + (64 << 20)),
                                  min_free=Size(0)))
    cpu = CpuStagingPath(store)
    gds: dict[str, Any] = gds_facts()
    results = []
    try:
        t0 = time.perf_counter()
        populate(cpu, pages)
        notes.append(f"stored {pages.shape[0]} pages ({need / 2**30:.2f} GiB) in "
                     f"{time.perf_counter() - t0:.1f} s")
        gds_path = None
        if dry_run:
            gds["skipped"] = "dry run: no GPU"
        elif gds.get("kvikio") is None:
            gds["skipped"] = gds.get("why", "kvikio absent")
        else:
            from offload.transfer.gds import GdsPath

            gds_path = GdsPath(store, fallback=cpu)
        for t in sorted(tokens):
            n = t // PAGE_TOKENS
            row: dict[str, Any] = {"tokens": t, "kv_bytes": n * pages.shape[1],
                                   "prefill_s": round(times[t], 4)}
            row["cpu_staging_s"] = round(load(cpu, pages, n, device, cache_dir), 4)
            if gds_path is not None:
                try:
                    took = load(gds_path, pages, n, device, cache_dir)
                except RuntimeError:
                    if not gds_path._no_gds:
                        raise
                    # cuFile refused a file: its first page a miss (a failed transfer,
                    # gds.failure_counts); the compat-mode figure below stands instead
                gds["transfer_failures"] = gds_path.failure_counts()
                if gds_path._no_gds:
                    gds["mode"] = ("compat: cuFile (compat mode OFF) refused the store's files, "
                                   "so they were read by kvikio in compat mode (POSIX reads "
                                   "through bounce buffers): not GPUDirect Storage")
                    took = load_kvikio_compat(store, pages, n, cache_dir)
                else:
                    gds["mode"] = "GPUDirect Storage (cuFile, compat mode OFF)"
                row["gds_s"] = round(took, 4)
            for key in ("cpu_staging_s", "gds_s"):
                if row.get(key):
                    row[key[:-2] + "_gbps"] = round(row["kv_bytes"] / row[key] / 1e9, 2)
                    row[key[:-2] + "_speedup_vs_prefill"] = round(
                        row["prefill_s"] / row[key], 2)
            results.append(row)
            print(f"gpu_proof: {t} tokens: {json.dumps(row)}", flush=True)
        if gds_path is not None:
            gds_path.close()
    finally:
        cpu.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "dry_run": dry_run, "machine": machine(),
              "model": {"name": name, **asdict(shape), "dtype": "bf16", "attention": "torch SDPA"},
              "kv_bytes_per_token": per_token, "page_tokens": PAGE_TOKENS,
              "block_bytes": int(pages.shape[1]), "store": cache_dir, "gds": gds,
              "results": results, "notes": notes}
    result["plot"] = write_plot(result, out / "gpu-proof.png")
    (out / "gpu-proof.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _row_figures(result: dict[str, Any], length: int) -> dict[str, Any]:
    """One bench serve --json result at `length` tokens: its KV dtype, the store's bytes per
    block, the cold and L3 times to first token and whether the L3 hit gave the cold output."""
    row = result.get("rows", {}).get(str(length)) or {}
    store = result.get("store") or {}
    block = store.get("block_bytes")
    if block is None and store.get("blocks"):
        block = store["data_bytes"] // store["blocks"]
    return {"dtype": (result.get("server") or {}).get("kv_cache_dtype"), "block_bytes": block,
            "cold_s": (row.get("cold") or {}).get("ttft_s"),
            "l3_s": (row.get("l3") or {}).get("ttft_s"),
            "same": (row.get("l3") or {}).get("same_output")}


def fp8_summary(bf16: dict[str, Any], fp8: dict[str, Any], length: int) -> list[str]:
    """The FP8 lines of the proof: bf16's and fp8's bench serve at one length side by side (the
    L3's bytes per block, cold vs the L3 hit), with fp8/bf16 ratios where both have a figure."""
    b, f = _row_figures(bf16, length), _row_figures(fp8, length)

    def pair(key: str, unit: str, fmt: str) -> str:
        vals = [d[key] for d in (b, f)]
        text = " vs ".join("-" if v is None else format(v, fmt) + unit for v in vals)
        if all(isinstance(v, (int, float)) and v for v in vals):
            text += f" (fp8/bf16 {vals[1] / vals[0]:.2f}x)"
        return text

    def same(d: dict[str, Any]) -> str:
        return {True: "yes", False: "NO"}.get(d["same"], "-")

    return [f"fp8 KV cache vs bf16 at {length} tokens ({f['dtype']} vs {b['dtype']}, each its "
            "own restart):",
            f"  L3 bytes per block {pair('block_bytes', '', 'd')}",
            f"  cold TTFT {pair('cold_s', ' s', '.3f')}",
            f"  L3 hit TTFT {pair('l3_s', ' s', '.3f')}",
            f"  L3 hit gives its own cold output: bf16 {same(b)}, fp8 {same(f)}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--tokens", default="32768,65536,131072",
                   help="prompt lengths, multiples of 64 (default 32K, 64K, 128K)")
    p.add_argument("--cache-dir", default="/tmp/sglang-offload-gpu-proof",
                   help="the block store's directory on local disk (removed at the end)")
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, no GPU parts")
    p.add_argument("--fp8-summary", nargs=2, metavar=("BF16_JSON", "FP8_JSON"), type=Path,
                   help="only print bf16's and fp8's bench serve --json results side by side at "
                   "the longest of --tokens (gpu-proof.sh: after both bench serve steps)")
    args = p.parse_args(argv)
    if args.fp8_summary:
        try:
            bf16, fp8 = (json.loads(f.read_text()) for f in args.fp8_summary)
        except (OSError, ValueError) as e:
            print(f"gpu_proof: --fp8-summary: {e}", file=sys.stderr)
            return 1
        for line in fp8_summary(bf16, fp8, max(int(x) for x in args.tokens.split(","))):
            print(f"gpu-proof: {line}")
        return 0
    tokens = [int(x) for x in args.tokens.split(",")]
    if any(t % PAGE_TOKENS for t in tokens):
        p.error(f"--tokens: each length must be a multiple of {PAGE_TOKENS}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_proof: no CUDA GPU visible to torch: run with --dry-run", file=sys.stderr)
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.out, tokens, args.cache_dir, args.dry_run)
    print(f"gpu_proof: wrote {args.out / 'gpu-proof.json'} and gpu-proof.png ({result['plot']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
