"""The Redis tier against other clients of the same Redis (issue 14): values bound to their keys
and authenticated by `redis.secret_file`; per-tenant key prefixes; the ACL recipe of
docs/deploy/redis.md applied to a real redis-server, tenant by tenant."""

from __future__ import annotations

import logging
import os
import re
import shlex
import struct
from pathlib import Path

import pytest

from offload.config import ConfigError, load_offload
from offload.events.chain import Row
from offload.events.feeds import RedisFeed
from offload.keys import Namespace
from offload.secret import read_secret_file
from offload.store.base import get_bytes
from offload.store.redis.store import RedisStore
from offload.store.redis.value import BOUND, HEADER, ValueCodec
from offload.store.tiered import TieredStore, WriteThrough
from tests.store.redis_fixtures import RedisProc, block_bytes, redis_factory, redis_server  # noqa: F401
from tests.store.stores import open_store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NS = Namespace("test-model", "bf16", "layer_first", 16)
SIZE = 4096


def secret_file(tmp_path: Path, name: str = "redis.secret", mode: int = 0o600,
                value: bytes = b"0123456789abcdef0123456789abcdef") -> str:
    p = tmp_path / name
    p.write_bytes(value + b"\n")
    p.chmod(mode)
    return str(p)


def make(url: str, **redis: object) -> RedisStore:
    return RedisStore(load_offload({"redis": {"url": url, "timeout_s": 2.0, **redis}}).redis)


def keys(n: int, start: int = 0) -> list[bytes]:
    return [NS.key(f"page-{i}") for i in range(start, start + n)]


def disk(tmp_path: Path, name: str) -> object:
    return open_store(tmp_path / name, 64 << 20, o_direct="off")


# -- values bound to their keys ----------------------------------------------------------------
@pytest.mark.parametrize("with_secret", [True, False])
def test_values_rotated_between_keys_are_misses_never_tiered_never_deleted(
        redis_server: RedisProc, tmp_path: Path, with_secret: bool) -> None:
    """16 values rotated between keys inside Redis: a fresh replica serves none and copies none
    into its local NVMe store (before issue 14: served all 16 as the wrong blocks), and deletes
    none (before issue 26: deleted all 16, values it could not prove were its own)."""
    extra = {"secret_file": secret_file(tmp_path)} if with_secret else {}
    writer = make(redis_server.url, **extra)
    ks = keys(16)
    assert writer.put_many(ks, [[block_bytes(str(i), SIZE)] for i in range(16)]) == [True] * 16
    r = redis_server.client()
    rkeys = [writer.rkey(k) for k in ks]
    values = [r.get(k) for k in rkeys]
    for k, v in zip(rkeys, values[1:] + values[:1]):
        r.set(k, v)
    local = disk(tmp_path, "replica")
    replica = TieredStore(local, make(redis_server.url, **extra), WriteThrough())  # type: ignore
    dests = [[bytearray(SIZE)] for _ in ks]
    assert replica.get_many(ks, dests) == [False] * 16
    assert local.exists_many(ks) == [False] * 16, "a moved value must never reach NVMe"
    assert r.exists(*rkeys) == 16, "values we cannot verify are left in place"
    assert replica.stats().extra["shared"]["checksum_failures"] == 16
    replica.close()


def test_forged_and_truncated_values_are_misses_left_in_place(redis_server: RedisProc,
                                                        tmp_path: Path) -> None:
    store = make(redis_server.url, secret_file=secret_file(tmp_path))
    assert store.codec.authenticated and store.stats().extra["authenticated"] is True
    k = keys(1)
    rk = store.rkey(k[0])
    r = redis_server.client()
    body = block_bytes("forged", SIZE)
    good = ValueCodec(b"0123456789abcdef0123456789abcdef").seal(rk, [body]) + body
    forgeries = {
        # A writer without the secret: sealed with another key, or the public (no-secret) key.
        "other_secret": ValueCodec(b"another secret, 32 bytes long!!!").seal(rk, [body]) + body,
        "public_key": ValueCodec(None).seal(rk, [body]) + body,
        # Cut short with the length in the header fixed up to match: the tag still fails.
        "truncated": (good[:8] + struct.pack("<Q", SIZE - 100) + good[16:HEADER.size]
                      + body[:SIZE - 100]),
        "tag_zeroed": good[:HEADER.size - 16] + bytes(16) + body,
    }
    assert store.codec.open(rk, good) is not None           # the genuine value opens
    for kind, value in forgeries.items():
        r.set(rk, value)
        assert store.get_many(k, [[bytearray(SIZE)]]) == [False], kind
        assert r.get(rk) == value, f"{kind}: deleted or changed"
    assert store.stats().checksum_failures == len(forgeries)


def test_without_a_secret_a_warning_names_the_setting_once(
        redis_server: RedisProc, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import offload.store.redis.store as redis_mod

    monkeypatch.setattr(redis_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="offload.store.redis.store"):
        store = make(redis_server.url)
        make(redis_server.url)                        # a second store (a bench size, a rank)
        make(redis_server.url).close()
    assert caplog.text.count("secret_file is unset") == 1, caplog.text
    with caplog.at_level(logging.WARNING, logger="offload.store.redis.store"):
        make(redis_server.url, key_prefix="sglo:other")   # another tenant's prefix: its own line
    assert caplog.text.count("secret_file is unset") == 2, caplog.text
    assert store.stats().extra["authenticated"] is False
    assert ValueCodec(None).kind == BOUND     # a digest bound to the key: no MAC without a secret


def test_no_value_downgrades_or_upgrades_between_the_two_kinds() -> None:
    rk, body = b"sglo:v2:" + bytes(32), block_bytes("x", SIZE)
    bound, authed = ValueCodec(None), ValueCodec(b"0123456789abcdef0123456789abcdef")
    assert bound.open(rk, bound.seal(rk, [body]) + body) is not None
    assert authed.open(rk, authed.seal(rk, [body]) + body) is not None
    assert authed.open(rk, bound.seal(rk, [body]) + body) is None    # no downgrade
    assert bound.open(rk, authed.seal(rk, [body]) + body) is None
    assert bound.open(rk + b"x", bound.seal(rk, [body]) + body) is None   # bound to its key


def test_secret_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    assert read_secret_file(secret_file(tmp_path), "s") == b"0123456789abcdef0123456789abcdef"
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret_file(secret_file(tmp_path, "open", mode=0o644), "offload.redis.secret_file")
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret_file(secret_file(tmp_path, "short", value=b"tiny"), "s")
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(str(tmp_path / "missing"), "s")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret_file(str(tmp_path), "s")
    with pytest.raises(ConfigError, match="offload.redis.secret_file"):
        make("redis://127.0.0.1:1", secret_file=secret_file(tmp_path, "o2", mode=0o640))


# -- key prefixes --------------------------------------------------------------------------------
def test_key_prefix_confines_keys_and_clear(redis_server: RedisProc) -> None:
    a = make(redis_server.url, key_prefix="sglo:tenant-a", max_bytes="1MiB")
    b = make(redis_server.url, key_prefix="sglo:tenant-b", max_bytes="1MiB")
    ks = keys(4)
    assert a.put_many(ks, [[block_bytes("a", SIZE)]] * 4) == [True] * 4
    assert b.put_many(ks, [[block_bytes("b", SIZE)]] * 4) == [True] * 4   # same block keys
    a.register_namespace(NS)
    b.register_namespace(NS)
    names = redis_server.client().keys(b"*")
    assert names and all(n.startswith((b"sglo:tenant-a:v2:", b"sglo:tenant-b:v2:")) for n in names)
    assert get_bytes(a, ks[0], SIZE) == block_bytes("a", SIZE)
    assert get_bytes(b, ks[0], SIZE) == block_bytes("b", SIZE)
    assert a.clear() == 4                                  # its blocks only, nothing of b's
    assert a.exists_many(ks) == [False] * 4 and b.exists_many(ks) == [True] * 4
    assert b.stats().bytes_used == 4 * SIZE
    left = set(redis_server.client().keys(b"sglo:tenant-a:*"))    # the record and a 0 counter
    assert left <= {b"sglo:tenant-a:v2:ns:" + NS.digest().hex().encode(),
                    b"sglo:tenant-a:v2:{idx}:bytes"}


@pytest.mark.parametrize("bad", ["", "a*", "a b", "x:v2", "{idx}", "a:b:c:d:e"])
def test_key_prefix_is_validated(bad: str) -> None:
    with pytest.raises(ConfigError, match="offload.redis.key_prefix"):
        load_offload({"redis": {"key_prefix": bad}})


# -- the ACL recipe of docs/deploy/redis.md --------------------------------------------------------
def _recipe(tenant: str, password: str) -> list[str]:
    """The documented `ACL SETUSER` line for tenant-a, rewritten for `tenant`."""
    text = (REPO / "docs" / "deploy" / "redis.md").read_text()
    line = re.search(r"^ACL SETUSER tenant-a .*$", text, re.M)
    assert line, "docs/deploy/redis.md lost its ACL recipe"
    words = shlex.split(line.group(0).replace("tenant-a", tenant))
    return [f">{password}" if w.startswith(">") else w for w in words]


def test_acl_recipe_confines_each_tenant(redis_factory, tmp_path: Path) -> None:  # noqa: F811
    import redis

    server = redis_factory(password="admin-password")
    admin = server.client()
    for tenant in ("tenant-a", "tenant-b"):
        assert admin.execute_command(*_recipe(tenant, f"{tenant}-password")) == b"OK"

    def store(tenant: str, prefix: str) -> RedisStore:
        return make(f"redis://{tenant}:{tenant}-password@127.0.0.1:{server.port}",
                    key_prefix=prefix, max_bytes="1MiB", ttl_s=600,
                    secret_file=secret_file(tmp_path, f"{tenant}.secret"))

    a, b = store("tenant-a", "sglo:tenant-a"), store("tenant-b", "sglo:tenant-b")
    ks = keys(6)
    for s, who in ((a, "a"), (b, "b")):      # everything the tier does works under the recipe
        assert s.put_many(ks, [[block_bytes(who, SIZE)]] * 6) == [True] * 6
        assert get_bytes(s, ks[0], SIZE) == block_bytes(who, SIZE)
        assert s.exists_many(ks) == [True] * 6 and s.delete_many(ks[:1]) == 1
        s.register_namespace(NS)
        s.ping()                              # ECHO, which every pipeline ends with
        assert s.stats().blocks == 5 and s.link.failures == 0, s.link.last_error
        feed = RedisFeed(s, NS.digest())      # KV events: XADD, and XRANGE in a script
        row = Row(ks[1], 7, None)
        assert feed.publish([row]) == [True] and feed.read() == [row], feed.link.last_error
        feed.close()
    a_keys = admin.keys(b"sglo:tenant-a:*")
    # Tenant B's credentials cannot read, overwrite or delete tenant A's keys ...
    rb = redis.Redis(host="127.0.0.1", port=server.port, username="tenant-b",
                     password="tenant-b-password")
    for cmd in (("GET", a_keys[0]), ("SET", a_keys[0], b"x"), ("DEL", a_keys[0]),
                ("KEYS", b"*"), ("FLUSHDB",), ("CONFIG", "GET", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            rb.execute_command(*cmd)
    # ... not even through our store pointed at A's prefix: every call misses.
    thief = store("tenant-b", "sglo:tenant-a")
    assert thief.get_many(ks[1:], [[bytearray(SIZE)] for _ in ks[1:]]) == [False] * 5
    assert thief.put_many(keys(1, 50), [[bytes(SIZE)]]) == [False]
    assert thief.clear() == 0
    assert sorted(admin.keys(b"sglo:tenant-a:*")) == sorted(a_keys)
    # B's own clear() is confined to B's prefix; A still serves its blocks.
    assert b.clear() == 5
    assert a.get_many(ks[1:], [[bytearray(SIZE)] for _ in ks[1:]]) == [True] * 5
    for s in (a, b, thief):
        s.close()
    assert os.stat(tmp_path / "tenant-a.secret").st_mode & 0o077 == 0
