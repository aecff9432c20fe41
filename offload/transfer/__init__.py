"""How bytes move between memory (host pool pages, or GPU memory where allowed) and a store.

`base` (the `TransferPath` interface, `StoreBookkeeping`, and `open_path`, routed by the decided
path through the `PATHS` registry), `cpu_staging` (NUMA-pinned handoff to the disk store's O_DIRECT
I/O), `gds` (kvikio cuFile, GPU <-> NVMe). The dpu path is the agent's client,
`offload.agent.client.AgentStore`, reached through the same registry (no import between the two
packages). Heavy libraries (NIXL, kvikio, torch) are imported on first use.
"""
