"""One store over several drives (`offload.store.paths`, `offload/store/disk/spread/`).

Real directories; where this machine lets the tests mount (root, loop devices), real separate
file systems: ext4 images of different sizes on loop devices, unmounted and mounted again under a
live store. Covers spreading by key, one cap and one eviction order, a drive removed and returned,
a full drive, a restart (with a drive missing), a corrupt block on one drive, slots across drives,
and `sglang-offload cache` over several directories.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from offload.config import Size, StoreConfig
from offload.store.base import get_bytes
from offload.store.disk.spread import SpreadStore
from offload.store.disk.spread.drives import rank
from tests.store.blocks import NS, data, key

pytestmark = pytest.mark.slow

BLOCK = 64 << 10


def cfg(dirs: list[Path], cap: int = 64 << 20, **kw: object) -> StoreConfig:
    args: dict[str, object] = {"min_free": Size(0), "o_direct": "auto", **kw}
    return StoreConfig(paths=tuple(str(d) for d in dirs), capacity=Size(cap),
                       **args)  # type: ignore[arg-type]


def put(store: SpreadStore, ids: range, size: int = BLOCK) -> list[bool]:
    ks = [key(i) for i in ids]
    return store.put_many(ks, [[data(k, size)] for k in ks])


def readable(store: SpreadStore, ids: range, size: int = BLOCK) -> list[bool]:
    return [get_bytes(store, key(i), size) == data(key(i), size) for i in ids]


def never_wrong(store: SpreadStore, ids: range, size: int = BLOCK) -> int:
    """Read the blocks; every hit must carry the right bytes. Returns the hits."""
    ks = [key(i) for i in ids]
    bufs = [bytearray(size) for _ in ks]
    ok = store.get_many(ks, [[b] for b in bufs])
    assert all(bytes(b) == data(k, size) for k, b, o in zip(ks, bufs, ok) if o)
    return sum(ok)


def held(store: SpreadStore) -> dict[str, int]:
    return {d["path"]: d.get("blocks", 0) for d in store.stats().extra["drives"]}  # type: ignore


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    return [tmp_path / f"nvme{i}" / "offload" for i in range(3)]


def test_blocks_spread_by_key_and_every_process_finds_them(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs), monitor=False) as s:
        assert all(put(s, range(300)))
        assert s.flush()
        counts = held(s)
    assert sum(counts.values()) == 300
    assert all(60 <= n <= 140 for n in counts.values()), counts   # ~100 each (equal weights)
    # another store with the same paths (another process, a restart) finds every block where the
    # placement says, without a global lookup; the order of `paths` does not matter
    with SpreadStore(cfg(list(reversed(dirs))), monitor=False) as s2:
        assert all(readable(s2, range(300)))
        assert s2.stats().blocks == 300
        # each block is on the first drive of its order
        for i in range(0, 300, 7):
            first = rank(key(i), s2.drives())[0]
            assert first.store is not None and first.store.exists_many([key(i)]) == [True]


def test_a_batch_runs_on_every_drive_at_once(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs), monitor=False) as s:
        assert all(put(s, range(60)))
        s.flush()
        before = {d["path"]: d["bytes_read"] for d in s.stats().extra["drives"]}  # type: ignore
        assert all(readable(s, range(60)))
        after = {d["path"]: d["bytes_read"] for d in s.stats().extra["drives"]}  # type: ignore
    assert all(after[p] > before[p] for p in after)    # every drive served its part


def test_one_cap_and_one_eviction_order(dirs: list[Path]) -> None:
    cap = 12 << 20      # 192 blocks of 64 KiB; 600 are written
    with SpreadStore(cfg(dirs, cap=cap), monitor=False) as s:
        for start in range(0, 600, 20):
            put(s, range(start, start + 20))
            s.flush()
        st = s.stats()
        assert st.bytes_used <= cap
        assert st.evictions > 0
        kept = [i for i, ok in enumerate(s.exists_many([key(i) for i in range(600)])) if ok]
    # least recently used go first on every drive, so what is kept is the newest, whichever drive
    newest = set(range(600 - len(kept), 600))
    assert len(newest & set(kept)) >= 0.85 * len(kept), (len(kept), min(kept))
    assert len(kept) >= 0.6 * (cap * 0.85 // (BLOCK + 4096))


def test_a_drive_removed_and_returned(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs), monitor=False) as s:
        assert all(put(s, range(200)))
        s.flush()
        gone = dirs[1]
        on_gone = [i for i in range(200)
                   if rank(key(i), s.drives())[0].path == str(gone)]
        assert on_gone
        aside = gone.with_name("offload.removed")
        gone.rename(aside)                  # the drive disappears (unplugged, unmounted)
        s.check()
        states = {d.path: d.state for d in s.drives()}
        assert states[str(gone)] == "out"
        ok = readable(s, range(200))
        assert not any(ok[i] for i in on_gone)              # its blocks are misses
        assert all(ok[i] for i in range(200) if i not in on_gone)   # the others serve
        # writes go on: a key ranked first on the lost drive goes to its second
        assert all(put(s, range(200, 260)))
        s.flush()
        aside.rename(gone)                  # back
        s.check()
        assert {d.path: d.state for d in s.drives()}[str(gone)] == "in"
        assert all(readable(s, range(260)))  # its own blocks again, and those put meanwhile
        assert s.drives()[1].outages == 1


def test_a_full_drive_is_read_not_written(dirs: list[Path]) -> None:
    full = {str(dirs[0])}

    def free(path: str) -> int:
        return 0 if any(path.startswith(f) for f in full) else 1 << 40

    c = cfg(dirs, min_free=Size(1 << 20))
    with SpreadStore(c, free_bytes=free, monitor=False) as s:
        assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "in"
        full.clear()
        assert all(put(s, range(150)))
        s.flush()
        full.add(str(dirs[0]))
        s.check()
        assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "full"
        n0 = held(s)[str(dirs[0])]
        assert all(put(s, range(150, 300)))      # none of them lands on the full drive
        s.flush()
        assert held(s)[str(dirs[0])] == n0
        assert all(readable(s, range(300)))      # and its blocks are still read


def test_restart_with_a_drive_missing_does_not_create_it(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs), monitor=False) as s:
        assert all(put(s, range(120)))
    aside = dirs[2].with_name("offload.aside")
    dirs[2].rename(aside)
    with SpreadStore(cfg(dirs), monitor=False) as s:
        d2 = {d.path: d for d in s.drives()}[str(dirs[2])]
        assert d2.state == "out" and "does not exist" in d2.why
        assert not dirs[2].exists()           # a drive not mounted is not made on the parent fs
        ok = readable(s, range(120))
        assert 0 < sum(ok) < 120
        aside.rename(dirs[2])
        s.check()
        assert all(readable(s, range(120)))


def test_no_drive_at_all_is_a_clear_error(tmp_path: Path) -> None:
    from offload.errors import StoreError

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.write_text("not a directory")
    with pytest.raises(StoreError, match="no drive could be opened"):
        SpreadStore(cfg(dirs), monitor=False)


def test_a_corrupt_block_on_one_drive_is_a_miss(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs), monitor=False) as s:
        assert all(put(s, range(30)))
        s.flush()
    slab = next(p for p in dirs[0].rglob("*") if p.is_file() and p.stat().st_size > BLOCK
                and p.name != "index.db")
    with open(slab, "r+b") as f:
        f.seek(8192 + 100)
        f.write(b"\xff" * 64)
    with SpreadStore(cfg(dirs), monitor=False) as s:
        ok = readable(s, range(30))
        assert sum(ok) == 29
        assert s.stats().checksum_failures == 1


def test_slots_are_routed_to_their_drive(dirs: list[Path]) -> None:
    from offload.store.disk.slab import format as slot_format

    ks = [key(i) for i in range(40)]
    with SpreadStore(cfg(dirs), monitor=False) as s:
        slots = s.reserve_slots(ks, [BLOCK] * len(ks))
        assert all(slots)
        assert len({next(str(d) for d in dirs if sl.path.startswith(str(d)))
                    for sl in slots if sl}) == 3      # a file per drive
        sums = []
        for k, sl in zip(ks, slots):
            assert sl is not None
            b = data(k, BLOCK)
            fd = os.open(sl.path, os.O_WRONLY)
            os.pwrite(fd, b, sl.offset)
            os.close(fd)
            sums.append(slot_format.wsum64([b]))
        assert all(s.commit_slots([sl for sl in slots if sl], sums))
        pinned = s.pin_slots(ks)
        assert all(p is not None and p.checksum == c for p, c in zip(pinned, sums))
        s.unpin_slots([p for p in pinned if p])
        assert all(readable(s, range(40)))


@contextmanager
def ext4(tmp: Path, name: str, mib: int) -> Iterator[Path]:
    """An ext4 file system of `mib` MiB on a loop device, mounted at tmp/name."""
    img, mnt = tmp / f"{name}.img", tmp / name
    mnt.mkdir()
    subprocess.run(["truncate", "-s", f"{mib}M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a loop device here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _can_mount() -> str:
    if os.geteuid() != 0:
        return "needs root (mount)"
    if not shutil.which("mkfs.ext4") or not shutil.which("losetup"):
        return "needs mkfs.ext4 and losetup"
    return ""


@pytest.mark.skipif(bool(_can_mount()), reason=_can_mount() or "ok")
def test_real_drives_of_different_sizes_unmounted_and_back(tmp_path: Path) -> None:
    with ext4(tmp_path, "small", 64) as small, ext4(tmp_path, "big", 192) as big:
        dirs = [small / "offload", big / "offload"]
        c = cfg(dirs, cap=160 << 20)
        with SpreadStore(c, monitor=False) as s:
            caps = {d.path: d.capacity for d in s.drives()}
            # the cap is split by size (~1:3), and the keys follow the shares
            assert 2.0 < caps[str(dirs[1])] / caps[str(dirs[0])] < 4.0
            assert all(put(s, range(400)))
            s.flush()
            n = held(s)
            assert 1.8 < n[str(dirs[1])] / n[str(dirs[0])] < 4.5, n
            # the small drive is unmounted under the live store
            subprocess.run(["umount", "-l", str(small)], check=True)
            s.check()
            assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "out"
            ok = readable(s, range(400))
            assert sum(ok) == n[str(dirs[1])]        # only the big drive's blocks, all right
            assert not dirs[0].exists()              # nothing written on the mount point
            subprocess.run(["mount", "-o", "loop", str(tmp_path / "small.img"), str(small)],
                           check=True)
            s.check()
            assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "in"
            assert all(readable(s, range(400)))       # its blocks were kept


@pytest.mark.skipif(bool(_can_mount()), reason=_can_mount() or "ok")
def test_a_really_full_drive(tmp_path: Path) -> None:
    with ext4(tmp_path, "tiny", 32) as tiny, ext4(tmp_path, "roomy", 128) as roomy:
        dirs = [tiny / "offload", roomy / "offload"]
        with SpreadStore(cfg(dirs, cap=140 << 20, min_free=Size(8 << 20)), monitor=False) as s:
            filler = tiny / "filler"
            subprocess.run(["fallocate", "-l", "22M", str(filler)], check=True)
            s.check()
            assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "full"
            assert all(put(s, range(200)))      # every block went to the other drive
            s.flush()
            assert held(s)[str(dirs[0])] == 0
            filler.unlink()
            s.check()
            assert {d.path: d.state for d in s.drives()}[str(dirs[0])] == "in"


def _shut_down(mount_point: Path) -> None:
    """Make every I/O on an ext4 file system fail with EIO, as a dying drive does (the kernel's
    EXT4_IOC_SHUTDOWN, without flushing the log)."""
    import fcntl
    import struct

    fd = os.open(mount_point, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))
    finally:
        os.close(fd)


@pytest.mark.skipif(bool(_can_mount()), reason=_can_mount() or "ok")
def test_a_drive_failing_with_io_errors_is_taken_out_and_rejoins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read and write of one drive fails with EIO: it is taken out, its blocks are misses,
    nothing wrong is served, the other drive serves and takes the writes; once the drive is
    mounted again it rejoins with the blocks it held."""
    import offload.store.disk.spread.drives as spread

    monkeypatch.setattr(spread, "PROBE_S", 0.0)       # probe on every check
    with ext4(tmp_path, "flaky", 64) as flaky, ext4(tmp_path, "good", 64) as good:
        dirs = [flaky / "offload", good / "offload"]
        with SpreadStore(cfg(dirs, cap=100 << 20), monitor=False) as s:
            assert all(put(s, range(100)))
            s.flush()
            n = held(s)
            _shut_down(flaky)
            never_wrong(s, range(100))        # before the check: reads fail, never wrong bytes
            s.check()
            d0 = s.drives()[0]
            assert d0.state == "out" and "Input/output error" in d0.why, d0
            assert sum(readable(s, range(100))) == n[str(dirs[1])]
            assert all(put(s, range(100, 140)))       # writes go on, to the good drive
            s.flush()
            subprocess.run(["umount", "-l", str(flaky)], check=True)
            subprocess.run(["mount", "-o", "loop", str(tmp_path / "flaky.img"), str(flaky)],
                           check=True)
            s.check()
            assert s.drives()[0].state == "in", s.drives()[0]
            assert all(readable(s, range(140)))      # its blocks were kept (journal replayed)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "offload.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_cache_commands_per_drive_and_across_all(dirs: list[Path]) -> None:
    with SpreadStore(cfg(dirs, cap=48 << 20), monitor=False) as s:
        s.register_namespace(NS)
        assert all(put(s, range(90)))
    ds = [str(d) for d in dirs]
    r = run_cli("cache", "stats", *ds)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("drive ") == 3 and "cache over 3 of 3 drives" in r.stdout
    assert "90 (" in r.stdout
    j = json.loads(run_cli("cache", "stats", "--json", *ds).stdout)
    assert j["blocks"] == 90 and len(j["drives"]) == 3 and j["capacity"] >= 47 << 20
    assert len(j["namespaces"]) == 1 and j["namespaces"][0]["blocks"] == 90
    v = run_cli("cache", "verify", *ds)
    assert v.returncode == 0 and "checked 90 blocks: 0 bad (3 of 3 drives)" in v.stdout, v.stdout
    e = run_cli("cache", "evict", "--to", "1MiB", *ds)
    assert e.returncode == 0, e.stderr
    left = json.loads(run_cli("cache", "stats", "--json", *ds).stdout)
    assert left["used_bytes"] <= (1 << 20) + 3 * (BLOCK + 4096)
    c = run_cli("cache", "clear", "--namespace", NS.digest().hex(), *ds)
    assert c.returncode == 0 and "on 3 of 3 drives" in c.stdout, c.stdout + c.stderr
    # a drive that is not there is reported, the others are still done (exit 1)
    shutil.rmtree(dirs[1])
    m = run_cli("cache", "stats", *ds)
    assert m.returncode == 1
    assert f"drive {ds[1]}: not done" in m.stdout and "cache over 2 of 3 drives" in m.stdout


def test_a_promotion_goes_to_each_drive_as_a_promotion(dirs: list[Path]) -> None:
    """`promote_many` (a tiered store's copy of a shared block, on a get's path) stores where a
    put would, through each drive's `promote_many` (which waits as a read does)."""
    with SpreadStore(cfg(dirs), monitor=False) as s:
        seen: list[int] = []
        for d in s.drives():
            assert d.store is not None
            real = d.store.promote_many
            d.store.promote_many = (  # type: ignore[method-assign]
                lambda ks, bs, real=real: (seen.append(len(ks)), real(ks, bs))[1])
        ks = [key(i) for i in range(30)]
        assert s.promote_many(ks, [[data(k, BLOCK)] for k in ks]) == [True] * 30
        assert sum(seen) == 30 and s.flush() and all(readable(s, range(30)))


_PROBES = """
import sys
from offload.store.disk.spread.drives import _probe
print(sum(1 for _ in range(int(sys.argv[2])) if _probe(sys.argv[1])), flush=True)
"""


def test_two_processes_probing_one_drive_never_take_it_out(tmp_path):
    """Every process of a node sharing the drives probes each one every 10 s. With one probe
    file name, one process truncated or deleted it between the other's write and read-back: a
    sound drive taken out ("probe read back other bytes", "No such file or directory"; 28 % of
    the probes of two processes probing at once). Real processes, a real directory."""
    d = tmp_path / "drive"
    d.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, "-c", _PROBES, str(d), "400"], env=env, text=True,
                              stdout=subprocess.PIPE) for _ in range(2)]
    failed = [int(p.communicate(timeout=600)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert failed == [0, 0]
    assert os.listdir(d) == []   # every probe file removed
