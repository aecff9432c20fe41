"""How bytes move between memory (host pool pages, or GPU memory where allowed) and a store.

`base` (the `TransferPath` interface and `open_path`, routed by the decided path), `cpu_staging`
(NUMA-pinned handoff to the disk store's O_DIRECT I/O), `gds` (kvikio cuFile, GPU <-> NVMe),
`dpu` (client of the DPU agent: NIXL moves the bytes), `nixl_util` (shared NIXL plumbing).
Heavy libraries (NIXL, kvikio, torch) are imported on first use.
"""
