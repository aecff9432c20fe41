"""The keys file and the namespace grants, in-process: what is refused, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.agent.access import Access, AccessError, register_msg
from offload.agent.auth import load_keys
from offload.errors import ConfigError
from offload.keys import Namespace

NS = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, salt="tenant-a")


def keys_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    p = tmp_path / "keys.toml"
    p.write_text(text)
    p.chmod(mode)
    return str(p)


def test_keys_file_problems_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chmod 600"):
        load_keys(keys_file(tmp_path, '[hosts.a]\nsecret = "x"\n', 0o644))
    text = ('[hosts."bad name"]\nsecret = "' + "a" * 32 + '"\nsalts = ["s"]\n'
            '[hosts.b]\nsecret = "short"\nnamespaces = ["nothex"]\n'
            '[hosts.c]\nsecret = "' + "c" * 32 + '"\nsalts = ["s"]\n'
            '[hosts.d]\nsecret = "' + "c" * 32 + '"\n')
    with pytest.raises(ConfigError) as e:
        load_keys(keys_file(tmp_path, text))
    msg = str(e.value)
    for part in ("host names are", "use at least 16", "32 lowercase hex", "the same as hosts.c",
                 "grants nothing"):
        assert part in msg
    for value in ("12345678901234567890", '["' + "a" * 32 + '"]', "1e300"):
        with pytest.raises(ConfigError, match="write the secret as a quoted string"):
            load_keys(keys_file(tmp_path, f'[hosts.a]\nsecret = {value}\nnamespaces = ["*"]\n'))


def test_grants_by_salt_by_digest_and_all(tmp_path: Path) -> None:
    other = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, salt="tenant-b")
    keys = load_keys(keys_file(tmp_path, (
        '[hosts.a]\nsecret = "' + "a" * 32 + '"\nsalts = ["tenant-a"]\n'
        '[hosts.b]\nsecret = "' + "b" * 32 + f'"\nnamespaces = ["{other.digest().hex()}"]\n'
        '[hosts.root]\nsecret = "' + "r" * 32 + '"\nnamespaces = ["*"]\n')))
    acc = Access.per_host(keys)
    assert acc.secret("a") == b"a" * 32 and acc.secret("nobody") is None
    assert acc.refused("a", [NS.key("p")]) is not None          # not registered yet
    ns = acc.register("a", register_msg(NS))
    assert ns.digest() == NS.digest() and ns.describe()["salt"] == "set"
    assert acc.refused("a", [NS.key("p")]) is None
    assert acc.refused("a", [other.key("p")]) is not None
    with pytest.raises(AccessError, match="not granted"):
        acc.register("a", register_msg(other))
    assert acc.refused("b", [other.key("p")]) is None            # listed digest: no registration
    assert acc.refused("root", [other.key("p"), NS.key("p")]) is None


def test_shared_secret_is_one_group_and_unsalted_digests_are_checked() -> None:
    acc = Access.shared(b"s" * 32)
    assert acc.secret("anyone") == b"s" * 32
    assert acc.refused("anyone", [NS.key("p")]) is None
    plain = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16)
    acc.register("h", register_msg(plain))
    lie = register_msg(Namespace(model="other", dtype="bf16", layout="page_first", page_size=16))
    with pytest.raises(AccessError, match="does not match"):
        acc.register("h", type(lie)(**{**{f: getattr(lie, f) for f in lie.__struct_fields__},
                                       "digest": plain.digest()}))


def test_pool_namespaces_are_granted_like_their_kv(tmp_path: Path) -> None:
    """A v2 sidecar pool (its own namespace, `pool` set) is described in full, so the agent can
    recompute its digest from the host's salt, and an unsalted one's digest is checked."""
    draft = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16,
                      salt="tenant-a", pool="draft")
    keys = load_keys(keys_file(tmp_path, '[hosts.a]\nsecret = "' + "a" * 32
                               + '"\nsalts = ["tenant-a"]\n'))
    acc = Access.per_host(keys)
    ns = acc.register("a", register_msg(draft))
    assert ns.digest() == draft.digest() and ns.describe()["pool"] == "draft"
    assert acc.refused("a", [draft.key("p")]) is None
    unsalted = Namespace(model="m", dtype="bf16", layout="page_first", page_size=16, pool="mamba")
    assert Access.shared(b"s" * 32).register("h", register_msg(unsalted)).digest() \
        == unsalted.digest()


def test_quotas_are_per_host_key_and_shared_secret_holders_are_one_tenant(tmp_path: Path) -> None:
    keys = tmp_path / "k.toml"
    keys.write_text('[hosts.a]\nsecret = "' + "a" * 32 + '"\nnamespaces = ["*"]\n'
                    '[hosts.b]\nsecret = "' + "b" * 32 + '"\nnamespaces = ["*"]\n')
    keys.chmod(0o600)
    acc = Access.per_host(load_keys(str(keys)), max_conns=2, max_requests=1)
    assert acc.connect("a") is None and acc.connect("a") is None
    assert "2 connections of host 'a'" in (acc.connect("a") or "")
    assert acc.connect("b") is None                     # a full tenant never refuses another
    assert acc.begin("a") is None and "in progress" in (acc.begin("a") or "")
    assert acc.begin("b") is None
    acc.end("a")
    assert acc.begin("a") is None
    shared = Access.shared(b"s" * 32, max_conns=2)
    assert shared.connect("x") is None and shared.connect("y") is None
    assert "shared secret's hosts" in (shared.connect("z") or "")
    shared.disconnect("x")
    assert shared.connect("z") is None


def test_a_connection_refused_at_admission_leaves_the_pending_count_balanced() -> None:
    from offload.agent.limits import AgentLimits
    from offload.agent.server import AgentServer
    from offload.store.memory.store import MemoryStore

    srv = AgentServer(MemoryStore(1 << 20), b"s" * 32, transport="tcp",
                      limits=AgentLimits(max_clients=1))
    srv._pending = 2                       # noqa: SLF001 - two accepted, authenticating
    assert srv.admit("a") is None
    assert srv.admit("b") is not None      # over --max-clients: refused, still pending
    srv.release(None)                      # the refused one closes
    srv.release("a")
    assert srv._pending == 0               # noqa: SLF001 - not driven below zero
    assert srv.access.usage()["tenants"] == 0
