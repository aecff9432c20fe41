"""A FUSE file system that forgets what was not made durable: SIGKILL it and you have a power cut.

    python tests/powerloss/lazyfs.py BACKING MOUNTPOINT [WRITEBACK [SEED]]
    (foreground; in the spirit of Jepsen's LazyFS)

Every operation acts on an in-memory view; the backing directory holds only what was made durable,
strictly per POSIX:
- file data (and size) is durable once that file is fsync'ed or fdatasync'ed;
- a name (created, renamed, linked, unlinked, a new directory) is durable once its parent directory
  is fsync'ed; a file whose name is not durable is lost whatever was fsync'ed into it.
With WRITEBACK > 0 it also does, at random (that chance per operation), what an OS may do at any
time: write one dirty page back, or commit a directory's entries as they are now; any subset of the
unsynced changes may then survive, as after a real power cut. With 0, none does.
So after `kill -9` of this process (plus a lazy unmount), BACKING is exactly the durable state of the
file system at the cut, and a fresh mount of it is the machine after the power came back.

Primitives: `File` (a shadow file `BACKING.inodes/ino-N` holding its durable bytes, dirty 4 KiB pages
and the volatile size in memory), `Dir` (volatile entries, and the entries as of its last fsync),
`LazyFS` (the mfusepy operations). A durable name in BACKING is a hard link to the shadow of its
file, so fsync'ing data updates every durable name at once and names move without copying. The
shadow directory sits beside BACKING (same file system) and is removed on every mount.
Locks (flock, fcntl) stay in the kernel: every user of the mount is on this machine. O_DIRECT opens
pass through the kernel's FUSE direct I/O; shared mmap (SQLite's -shm) works since files are not
opened with direct_io.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import shutil
import stat
import sys
import threading
import time
from typing import Any

PAGE = 4096
FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE = 0x01, 0x02


class File:
    def __init__(self, ino: int, shadow: str, mode: int, fd: int):
        self.ino, self.shadow, self.mode, self.fd = ino, shadow, mode, fd
        self.size = os.fstat(fd).st_size      # volatile size
        self.floor = self.size                # shadow bytes at or past this read as zeros
        self.pages: dict[int, bytearray] = {}  # dirty pages (not yet fsync'ed)
        self.mtime = time.time_ns()

    def _durable(self, off: int, n: int) -> bytes:
        n = max(0, min(n, self.floor - off))
        got = os.pread(self.fd, n, off) if n > 0 else b""
        return got

    def _page(self, i: int) -> bytearray:
        page = self.pages.get(i)
        if page is None:
            page = bytearray(self._durable(i * PAGE, PAGE).ljust(PAGE, b"\0"))
            self.pages[i] = page
        return page

    def read(self, off: int, n: int) -> bytes:
        n = max(0, min(n, self.size - off))
        if n == 0:
            return b""
        out = bytearray(self._durable(off, n).ljust(n, b"\0"))
        for i in range(off // PAGE, (off + n - 1) // PAGE + 1):
            page = self.pages.get(i)
            if page is not None:
                a, b = max(off, i * PAGE), min(off + n, (i + 1) * PAGE)
                out[a - off:b - off] = page[a - i * PAGE:b - i * PAGE]
        return bytes(out)

    def write(self, off: int, data: bytes, zero: bool = False) -> None:
        end = off + len(data)
        for i in range(off // PAGE, (end - 1) // PAGE + 1) if data else ():
            a, b = max(off, i * PAGE), min(end, (i + 1) * PAGE)
            self._page(i)[a - i * PAGE:b - i * PAGE] = data[a - off:b - off]
        if not zero:
            self.size = max(self.size, end)
        self.mtime = time.time_ns()

    def truncate(self, size: int) -> None:
        if size < self.size:
            self.floor = min(self.floor, size)
            for i in [i for i in self.pages if i * PAGE >= size]:
                del self.pages[i]
            if size % PAGE and size // PAGE in self.pages:
                self.pages[size // PAGE][size % PAGE:] = bytes(PAGE - size % PAGE)
        self.size = size
        self.mtime = time.time_ns()

    def writeback(self, rng: random.Random) -> None:
        """What the OS may do any time: make one dirty page durable (it stays in the live view)."""
        if not self.pages:
            return
        if self.floor < os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, self.floor)       # a pending truncation goes first
        i = rng.choice(list(self.pages))
        os.pwrite(self.fd, self.pages[i][:max(0, min(PAGE, self.size - i * PAGE))], i * PAGE)

    def sync(self) -> None:
        """Make this file's data and size durable (its shadow: every durable name of it)."""
        if self.floor < os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, self.floor)
        os.ftruncate(self.fd, self.size)
        for i, page in sorted(self.pages.items()):
            os.pwrite(self.fd, page[:min(PAGE, self.size - i * PAGE)], i * PAGE)
        self.pages.clear()
        self.floor = self.size


class Dir:
    def __init__(self, ino: int, mode: int):
        self.ino, self.mode = ino, mode
        self.children: dict[str, File | Dir] = {}   # what the mount shows now
        self.durable: dict[str, File | Dir] = {}    # the entries as of the last fsync of this dir
        self.mtime = time.time_ns()


Node = File | Dir


class LazyFS:
    use_ns = True

    def __init__(self, backing: str, writeback: float = 0.0, seed: int = 0):
        self.writeback = writeback            # chance, per operation, of an early writeback
        self.rng = random.Random(seed)
        self.backing = os.path.abspath(backing)
        self.shadows = self.backing.rstrip("/") + ".inodes"
        shutil.rmtree(self.shadows, ignore_errors=True)   # the orphans of the last power cut
        os.mkdir(self.shadows, 0o700)
        self._mu = threading.RLock()
        self._ino = itertools.count(2)
        self._fh = itertools.count(1)
        self.handles: dict[int, File] = {}
        self.root = self._load(self.backing, {})
        self.root.durable = dict(self.root.children)

    # ---- the durable state <-> BACKING ------------------------------------------------------------

    def _new_file(self, mode: int, existing: str | None = None) -> File:
        ino = next(self._ino)
        shadow = os.path.join(self.shadows, f"ino-{ino}")
        if existing is None:
            fd = os.open(shadow, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            os.link(existing, shadow)
            fd = os.open(shadow, os.O_RDWR)
        return File(ino, shadow, mode, fd)

    def _load(self, path: str, seen: dict[int, File]) -> Dir:
        d = Dir(next(self._ino), stat.S_IMODE(os.stat(path).st_mode))
        for entry in os.scandir(path):
            st = entry.stat(follow_symlinks=False)
            if entry.is_dir(follow_symlinks=False):
                d.children[entry.name] = self._load(entry.path, seen)
            elif entry.is_file(follow_symlinks=False):
                f = seen.get(st.st_ino) or self._new_file(stat.S_IMODE(st.st_mode), entry.path)
                seen[st.st_ino] = f
                d.children[entry.name] = f
        d.durable = dict(d.children)
        return d

    def _apply(self, d: Dir, path: str) -> None:
        """Make directory `path` in BACKING hold exactly `d.durable` (recursively for new dirs)."""
        have = {e.name: e for e in os.scandir(path)}
        for name, node in d.durable.items():
            target = os.path.join(path, name)
            e = have.get(name)
            if isinstance(node, File):
                if e is not None and not e.is_dir(follow_symlinks=False) \
                        and e.inode() == os.fstat(node.fd).st_ino:
                    continue
                tmp = os.path.join(self.shadows, f"link-{next(self._ino)}")
                os.link(node.shadow, tmp)
                if e is not None and e.is_dir(follow_symlinks=False):
                    shutil.rmtree(target)
                os.rename(tmp, target)      # atomic, like the directory block being written
            else:
                if e is not None and not e.is_dir(follow_symlinks=False):
                    os.unlink(target)
                if e is None or not e.is_dir(follow_symlinks=False):
                    os.mkdir(target, node.mode)
                    self._apply(node, target)
        for name, e in have.items():
            if name not in d.durable:
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path)
                else:
                    os.unlink(e.path)

    def _backing_path(self, d: Dir) -> str | None:
        """Where `d` is durable in BACKING (None: its name is not durable yet)."""
        def walk(node: Dir, path: str) -> str | None:
            if node is d:
                return path
            for name, child in node.durable.items():
                if isinstance(child, Dir):
                    got = walk(child, os.path.join(path, name))
                    if got is not None:
                        return got
            return None
        return walk(self.root, self.backing)

    # ---- lookups ---------------------------------------------------------------------------------

    def _node(self, path: str | None, fh: int | None = None) -> Node:
        if fh:
            got = self.handles.get(fh)
            if got is not None:
                return got
        if path is None:
            raise OSError(errno.EBADF, "no path")
        node: Node = self.root
        for part in [p for p in path.split("/") if p]:
            if not isinstance(node, Dir) or part not in node.children:
                raise OSError(errno.ENOENT, path)
            node = node.children[part]
        return node

    def _parent(self, path: str) -> tuple[Dir, str]:
        head, name = os.path.split(path.rstrip("/"))
        d = self._node(head or "/")
        if not isinstance(d, Dir):
            raise OSError(errno.ENOTDIR, head)
        return d, name

    def _file(self, path: str | None, fh: int | None) -> File:
        node = self._node(path, fh)
        if not isinstance(node, File):
            raise OSError(errno.EISDIR, path or "")
        return node

    # ---- operations (mfusepy) -------------------------------------------------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        with self._mu:
            node = self._node(path, fh)
            common = dict(st_ino=node.ino, st_uid=os.getuid(), st_gid=os.getgid(), st_mtime=node.mtime,
                          st_ctime=node.mtime, st_atime=node.mtime)
            if isinstance(node, Dir):
                return dict(st_mode=stat.S_IFDIR | node.mode, st_nlink=2, st_size=4096, **common)
            return dict(st_mode=stat.S_IFREG | node.mode, st_nlink=1, st_size=node.size,
                        st_blocks=(node.size + 511) // 512, st_blksize=PAGE, **common)

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        with self._mu:
            node = self._node(path)
            if not isinstance(node, Dir):
                raise OSError(errno.ENOTDIR, path)
            # Each entry with its inode number: glibc skips entries whose d_ino is 0.
            kinds = {File: stat.S_IFREG, Dir: stat.S_IFDIR}
            return [(".", {"st_ino": node.ino, "st_mode": stat.S_IFDIR}, 0),
                    ("..", {"st_ino": 1, "st_mode": stat.S_IFDIR}, 0),
                    *((name, {"st_ino": c.ino, "st_mode": kinds[type(c)]}, 0)
                      for name, c in node.children.items())]

    def _open_handle(self, f: File) -> int:
        fh = next(self._fh)
        self.handles[fh] = f
        return fh

    def create(self, path: str, mode: int, flags: int = 0) -> int:
        with self._mu:
            d, name = self._parent(path)
            node = d.children.get(name)
            if isinstance(node, Dir):
                raise OSError(errno.EISDIR, path)
            if node is None:
                node = self._new_file(stat.S_IMODE(mode))
                d.children[name] = node
                d.mtime = time.time_ns()
                self._maybe_commit(d)
            elif flags & os.O_TRUNC:
                node.truncate(0)
            return self._open_handle(node)

    def open(self, path: str, flags: int) -> int:
        with self._mu:
            return self._open_handle(self._file(path, None))

    def release(self, path: str | None, fh: int) -> int:
        with self._mu:
            self.handles.pop(fh, None)
        return 0

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        with self._mu:
            return self._file(path, fh).read(offset, size)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self._mu:
            f = self._file(path, fh)
            f.write(offset, data)
            if self.rng.random() < self.writeback:
                f.writeback(self.rng)
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self._mu:
            self._file(path, fh).truncate(length)
        return 0

    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fh: int) -> int:
        with self._mu:
            f = self._file(path, fh)
            if mode == FALLOC_PUNCH_HOLE | FALLOC_KEEP_SIZE:
                end = min(offset + size, f.size)
                if end > offset:
                    f.write(offset, bytes(end - offset), zero=True)
            elif mode in (0, FALLOC_KEEP_SIZE):
                if mode == 0 and offset + size > f.size:
                    f.truncate(offset + size)
            else:
                raise OSError(errno.EOPNOTSUPP, "fallocate mode")
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mu:
            self._file(path, fh).sync()
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mu:
            d = self._node(path)
            if not isinstance(d, Dir):
                raise OSError(errno.ENOTDIR, path or "")
            self._commit(d)
        return 0

    def _commit(self, d: Dir) -> None:
        d.durable = dict(d.children)
        where = self._backing_path(d)
        if where is not None:
            self._apply(d, where)

    def _maybe_commit(self, *dirs: Dir) -> None:
        """What a journal may do any time: make a directory's entries as they are now durable."""
        if self.rng.random() < self.writeback:      # one coin: a rename's two directories together
            for d in dirs:
                self._commit(d)

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str | None, fh: int) -> int:
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        with self._mu:
            d, name = self._parent(path)
            if name in d.children:
                raise OSError(errno.EEXIST, path)
            d.children[name] = Dir(next(self._ino), stat.S_IMODE(mode))
            self._maybe_commit(d)
        return 0

    def rmdir(self, path: str) -> int:
        with self._mu:
            d, name = self._parent(path)
            node = d.children.get(name)
            if not isinstance(node, Dir):
                raise OSError(errno.ENOTDIR if node else errno.ENOENT, path)
            if node.children:
                raise OSError(errno.ENOTEMPTY, path)
            del d.children[name]
            self._maybe_commit(d)
        return 0

    def unlink(self, path: str) -> int:
        with self._mu:
            d, name = self._parent(path)
            if isinstance(d.children.get(name), Dir) or name not in d.children:
                raise OSError(errno.EISDIR if name in d.children else errno.ENOENT, path)
            del d.children[name]
            d.mtime = time.time_ns()
            self._maybe_commit(d)
        return 0

    def rename(self, old: str, new: str) -> int:
        with self._mu:
            src, a = self._parent(old)
            dst, b = self._parent(new)
            if a not in src.children:
                raise OSError(errno.ENOENT, old)
            node = src.children[a]
            target = dst.children.get(b)
            if isinstance(target, Dir) and (not isinstance(node, Dir) or target.children):
                raise OSError(errno.EISDIR if not isinstance(node, Dir) else errno.ENOTEMPTY, new)
            del src.children[a]
            dst.children[b] = node
            self._maybe_commit(*{id(x): x for x in (src, dst)}.values())
        return 0

    def link(self, target: str, source: str) -> int:
        with self._mu:
            f = self._file(source, None)
            d, name = self._parent(target)
            if name in d.children:
                raise OSError(errno.EEXIST, target)
            d.children[name] = f
            self._maybe_commit(d)
        return 0

    def chmod(self, path: str | None, mode: int) -> int:
        with self._mu:
            self._node(path).mode = stat.S_IMODE(mode)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        with self._mu:
            self._node(path).mtime = times[1] if times else time.time_ns()
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self.backing)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                            "f_files", "f_ffree", "f_favail", "f_namemax")}


def main() -> None:
    import mfusepy

    backing, mountpoint = sys.argv[1], sys.argv[2]
    writeback = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    ops = type("LazyFSOps", (LazyFS, mfusepy.Operations), {})(backing, writeback, seed)
    mfusepy.FUSE(ops, mountpoint, foreground=True, nothreads=False, use_ino=True, hard_remove=True,
                 fsname="lazyfs")


if __name__ == "__main__":
    main()
