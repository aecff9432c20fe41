"""The storage agent a BlueField DPU (or a storage host) runs for many inference hosts.

`protocol` (frames, handshake, HMAC), `auth` (the shared secret), `server` (accept loop),
`session` (one host connection), `mover` (NIXL agent + staging memory), `cli` (`sglang-offload
agent`). The host side is `offload.transfer.dpu.AgentStore`.
"""
