"""DiskStore on real files: round trips, restart, capacity, eviction, corruption, namespaces."""

from __future__ import annotations

import json
import mmap
import os
import random
import sqlite3

import pytest

from offload.errors import StoreError
from offload.keys import Namespace
from offload.store.base import get_bytes, leading_hits
from tests.store.blocks import NS, data, key
from tests.store.stores import open_store, worker


@pytest.mark.parametrize("size", [1, 1000, 4096, 256 << 10, (1 << 20) + 3, 8 << 20])
def test_round_trip_sizes(tmp_path, size):
    with open_store(tmp_path) as s:
        ks = [key(i) for i in range(3)]
        assert s.put_many(ks, [[data(k, size)] for k in ks]) == [True] * 3
        for k in ks:
            assert get_bytes(s, k, size) == data(k, size)


@pytest.mark.parametrize("o_direct", ["auto", "off"])
def test_vectored_aligned_and_unaligned_buffers(tmp_path, o_direct):
    """A page that is one slice per layer (layer_first) is written and read in place."""
    layers, slice_bytes = 8, 64 << 10
    src = mmap.mmap(-1, layers * slice_bytes * 2)  # page aligned
    src.write(os.urandom(len(src)))
    with open_store(tmp_path, o_direct=o_direct) as s:
        aligned = [memoryview(src)[i * slice_bytes:(i + 1) * slice_bytes] for i in range(layers)]
        odd = bytearray(os.urandom(layers * slice_bytes + 1))  # unaligned address and length
        unaligned = [memoryview(odd)[1 + i * slice_bytes:1 + (i + 1) * slice_bytes]
                     for i in range(layers)]
        k1, k2 = key(1), key(2)
        assert s.put_many([k1, k2], [aligned, unaligned]) == [True, True]
        out = mmap.mmap(-1, layers * slice_bytes)
        dests = [memoryview(out)[i * slice_bytes:(i + 1) * slice_bytes] for i in range(layers)]
        assert s.get_many([k1], [dests]) == [True]
        assert out[:] == b"".join(bytes(a) for a in aligned)
        back = bytearray(layers * slice_bytes + 5)
        dests2 = [memoryview(back)[3 + i * slice_bytes:3 + (i + 1) * slice_bytes]
                  for i in range(layers)]
        assert s.get_many([k2], [dests2]) == [True]
        assert bytes(back[3:3 + layers * slice_bytes]) == bytes(odd[1:])
        assert s.stats().extra["o_direct"] is (o_direct == "auto")


def test_exists_leading_delete_and_wrong_destination(tmp_path):
    with open_store(tmp_path) as s:
        ks = [key(i) for i in range(5)]
        s.put_many(ks[:3], [[data(k, 5000)] for k in ks[:3]])
        assert s.exists_many(ks) == [True, True, True, False, False]
        assert leading_hits(s, [ks[0], ks[1], ks[4], ks[2]]) == 2
        assert s.get_many([ks[0]], [[bytearray(4999)]]) == [False]  # wrong size: a miss
        assert s.exists_many([ks[0]]) == [True]  # ... not a corruption
        assert s.delete_many([ks[1], ks[4]]) == 1
        assert s.exists_many(ks[:3]) == [True, False, True]
        assert s.put_many([b"short"], [[b"x"]]) == [False]  # bad key: skipped, no exception


def test_put_is_idempotent_and_dedups_within_a_batch(tmp_path):
    with open_store(tmp_path) as s:
        k = key(7)
        assert s.put_many([k, k], [[data(k, 9000)], [data(k, 9000)]]) == [True, True]
        assert s.put_many([k], [[data(k, 9000)]]) == [True]
        st = s.stats()
        assert st.blocks == 1 and st.puts == 1


def test_restart_in_a_new_process_sees_every_committed_block(tmp_path):
    p = worker("write", tmp_path, start=0, stop=40, size=70000)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and all(all(json.loads(line)["ok"]) for line in out.splitlines())
    p = worker("read", tmp_path, n=40, size=70000)
    res = json.loads(p.communicate(timeout=120)[0])
    assert res == {"exact": 40, "wrong": 0, "missing": 0, "exists": 40}


def test_two_processes_share_one_directory(tmp_path):
    with open_store(tmp_path) as s:
        s.put_many([key(0)], [[data(key(0), 4096)]])
        p = worker("write", tmp_path, start=1, stop=9, size=4096)
        p.communicate(timeout=120)
        # this process sees the other's commits without reopening
        assert s.exists_many([key(i) for i in range(9)]) == [True] * 9
        assert get_bytes(s, key(8), 4096) == data(key(8), 4096)


def test_lru_eviction_keeps_under_cap_and_drops_oldest(tmp_path):
    size = 60 << 10  # slot = 64 KiB
    cap = 20 * (64 << 10)
    with open_store(tmp_path, capacity=cap, high_watermark=0.9, low_watermark=0.5) as s:
        for i in range(10):
            assert s.put_many([key(i)], [[data(key(i), size)]]) == [True]
        s.get_many([key(0)], [[bytearray(size)]])  # block 0 is recently used now
        s._reads.flush_touches()
        for i in range(10, 30):
            assert s.put_many([key(i)], [[data(key(i), size)]]) == [True]
            assert s.stats().bytes_used <= cap
        present = s.exists_many([key(i) for i in range(30)])
        assert present[29] and not present[1]
        assert s.stats().evictions > 0
        for i in range(30):
            if present[i]:
                assert get_bytes(s, key(i), size) == data(key(i), size)


def test_block_larger_than_capacity_is_skipped_not_raised(tmp_path):
    with open_store(tmp_path, capacity=1 << 20) as s:
        assert s.put_many([key(1)], [[bytes(2 << 20)]]) == [False]
        assert s.stats().put_skipped == 1


def test_capacity_is_shared_and_last_opener_sets_it(tmp_path):
    a = open_store(tmp_path, capacity=64 << 20)
    b = open_store(tmp_path, capacity=32 << 20)
    assert a.stats().capacity == 32 << 20
    a.close(), b.close()


def test_corrupt_data_is_a_miss_and_is_deleted(tmp_path):
    size = 100_000
    with open_store(tmp_path) as s:
        ks = [key(i) for i in range(4)]
        s.put_many(ks, [[data(k, size)] for k in ks])
        loc = s._index.locate([ks[2]])[ks[2]]
        path = s._state.slabs.path(loc.seg, loc.slot_bytes)
    with open(path, "r+b") as f:  # flip one bit in block 2's data
        off = loc.slot * loc.slot_bytes + 4096 + 777
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    with open_store(tmp_path) as s:
        buf = bytearray(size)
        assert s.get_many([ks[2]], [[buf]]) == [False]
        assert s.exists_many(ks) == [True, True, False, True]
        assert s.stats().checksum_failures == 1
        assert get_bytes(s, ks[3], size) == data(ks[3], size)


def test_garbage_index_is_set_aside_and_rebuilt_from_slabs(tmp_path):
    size = 50_000
    with open_store(tmp_path) as s:
        ks = [key(i) for i in range(6)]
        s.put_many(ks, [[data(k, size)] for k in ks])
    for suffix in ("-wal", "-shm"):
        if os.path.exists(tmp_path / f"index.db{suffix}"):
            os.unlink(tmp_path / f"index.db{suffix}")
    (tmp_path / "index.db").write_bytes(os.urandom(8192))
    with open_store(tmp_path) as s:
        assert s.rebuilt_from and os.path.exists(s.rebuilt_from)
        assert s.exists_many(ks) == [True] * 6
        for k in ks:
            assert get_bytes(s, k, size) == data(k, size)


def test_unknown_schema_version_is_set_aside(tmp_path):
    with open_store(tmp_path) as s:
        s.put_many([key(1)], [[data(key(1), 4096)]])
    db = sqlite3.connect(tmp_path / "index.db")
    db.execute("UPDATE meta SET value=99 WHERE name='schema'")
    db.commit()
    db.close()
    with open_store(tmp_path) as s:
        assert s.rebuilt_from is not None
        assert get_bytes(s, key(1), 4096) == data(key(1), 4096)


def test_namespaces_and_salts_are_distinct_blocks(tmp_path):
    variants = [NS, Namespace("tiny", "float16", "page_first", 16),
                Namespace("tiny", "bfloat16", "layer_first", 16),
                Namespace("tiny", "bfloat16", "page_first", 32),
                Namespace("tiny", "bfloat16", "page_first", 16, tp_rank=1, tp_size=2),
                Namespace("other", "bfloat16", "page_first", 16),
                Namespace("tiny", "bfloat16", "page_first", 16, salt="tenant-a")]
    ks = [ns.key("page-0") for ns in variants]
    assert len(set(ks)) == len(variants)
    with open_store(tmp_path) as s:
        s.put_many(ks[:1], [[b"a" * 4096]])
        assert s.exists_many(ks) == [True] + [False] * (len(ks) - 1)
        s.register_namespace(NS)
        s.put_many(ks[1:2], [[b"b" * 4096]])
        assert s.clear(NS.digest()) == 1
        assert s.exists_many(ks[:2]) == [False, True]


def test_o_direct_on_refused_is_a_clear_error(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(StoreError, match="refuses O_DIRECT"):
        open_store(tmp_path, o_direct="on")
    with open_store(tmp_path, o_direct="auto") as s:  # auto falls back, still works
        assert s.put_many([key(1)], [[data(key(1), 5000)]]) == [True]
        assert get_bytes(s, key(1), 5000) == data(key(1), 5000)
        assert s.stats().extra["o_direct"] is False


def test_unwritable_directory_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="cannot create|is not a directory"):
        open_store(f / "sub")


def test_random_ops_never_return_wrong_bytes(tmp_path):
    rnd = random.Random(5)
    with open_store(tmp_path, capacity=3 << 20) as s:
        for _ in range(200):
            i = rnd.randrange(60)
            size = 1000 + 37 * i
            if rnd.random() < 0.6:
                s.put_many([key(i)], [[data(key(i), size)]])
            elif rnd.random() < 0.8:
                got = get_bytes(s, key(i), size)
                assert got is None or got == data(key(i), size)
            else:
                s.delete_many([key(i)])
        assert s.stats().bytes_used <= 3 << 20
