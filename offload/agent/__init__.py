"""The storage agent a BlueField DPU (or a storage host) runs for many inference hosts, and the
client that talks to it.

Agent side: `protocol` (frames, handshake, HMAC), `auth` (the shared secret, the keys file),
`access` (who may connect, which namespaces each host may use), `server` (accept loop),
`session` (one host connection), `mover` (NIXL agent, peers and their proof of possession,
staging memory, the store's arena), `direct` (zero-copy moves to/from the store's slots),
`staged` (the staging path), `acks` (puts acknowledged before durable, hidden until they are),
`quarantine` (memory a late transfer may still touch), `nixl_util`
(NIXL plumbing shared by both sides). Host side: `client.AgentStore` (the dpu transfer path, registered
in `offload.transfer.base.PATHS`) over `conn.AgentConn` control connections. The command is
`offload.commands.agent`.
"""
