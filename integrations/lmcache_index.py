"""The shared half of :class:`~.lmcache_store.KVFileStore`: lock, counters, index, eviction.

:class:`KVFolderIndex` is the base class of ``KVFileStore``. It owns what several processes
share through the folder, and this process's view of it, but never a chunk's contents:

* ``.fckv.lock``: the flock(2) lock (re-entrant per thread) and the shared counters
  (used bytes, generation) stored in it;
* the folder scan that rebuilds both (and removes stale temp files of dead writers);
* this process's LRU index of chunk names, its pins and its in-flight writes;
* lookup, removal (also of corrupt chunks) and LRU eviction down to ``max_bytes``.

Writing and reading chunk files is in :mod:`.lmcache_store`, which also describes the folder
layout and the rules (case C8); options, stats and handles are in :mod:`.lmcache_format`.
No LMCache import.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

from fastckpt.errors import InsufficientSpaceError

from .lmcache_format import LOCK_NAME, SUFFIX, ChunkHandle, KVStats, StoreOptions

# the store's logger name, as before this module was split out of lmcache_store
logger = logging.getLogger(__name__.rpartition(".")[0] + ".lmcache_store")

_LOCK_FMT = struct.Struct("<8sQQ")
_LOCK_MAGIC = b"FCKVLCK1"
#: Name of a committed chunk file (group 1: the chunk name).
FINAL_RE = re.compile(r"^([0-9a-f]{32})\.kv\.safetensors$")
#: Name of a chunk file being written, ``.tmp.<chunk name>.<host>.<pid>.<hex>`` (never a hit;
#: groups: chunk name, host, pid). :meth:`KVFolderIndex.temp_path_for` makes them.
TMP_RE = re.compile(r"^\.tmp\.([0-9a-f]{32})\.([^.]+)\.(\d+)\.[0-9a-f]+$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


class KVFolderIndex:
    """Shared counters, index, pins and eviction of one KV chunk folder (base of ``KVFileStore``).

    Constructed through :class:`~.lmcache_store.KVFileStore` (same argument, same errors):
    creates the folder, opens ``.fckv.lock`` and rebuilds the index and the shared
    used-bytes counter by a scan. The index, pins and in-flight set belong to this
    process (guarded by a thread lock); files and the counter are shared (guarded by
    the flock).
    """

    def __init__(self, options: StoreOptions):
        self.opts = options
        self.root = os.path.abspath(options.path)
        os.makedirs(self.root, exist_ok=True)
        self.stats = KVStats()
        self._tlock = threading.RLock()
        self._depth = 0
        self._lock_fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> bytes, LRU first
        self._pins: dict[str, int] = {}
        self._writing: set[str] = set()
        self._last_scan = 0.0
        self._my_gen = -1
        with self._locked():
            self._rescan_locked()

    # ----- paths and shared counters -------------------------------------------------
    def path_for(self, name: str) -> str:
        """Final path of chunk ``name``."""
        return os.path.join(self.root, name[:2], name + SUFFIX)

    def temp_path_for(self, name: str) -> str:
        """A fresh temporary path for writing chunk ``name`` in its sub-folder (see :data:`TMP_RE`:
        it names this host and process, so a scan can tell a dead writer's leftover)."""
        return os.path.join(self.root, name[:2], f".tmp.{name}.{_HOST}.{os.getpid()}.{os.urandom(4).hex()}")

    def _locked(self):
        store = self

        class _Ctx:  # re-entrant in one thread: the flock is taken at depth 0 -> 1 only
            def __enter__(self):
                store._tlock.acquire()
                store._depth += 1
                if store._depth == 1:
                    fcntl.flock(store._lock_fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                store._depth -= 1
                if store._depth == 0:
                    fcntl.flock(store._lock_fd, fcntl.LOCK_UN)
                store._tlock.release()

        return _Ctx()

    def _read_counters(self) -> tuple[int, int] | None:
        raw = os.pread(self._lock_fd, _LOCK_FMT.size, 0)
        if len(raw) != _LOCK_FMT.size:
            return None
        magic, used, gen = _LOCK_FMT.unpack(raw)
        return (used, gen) if magic == _LOCK_MAGIC else None

    def _write_counters(self, used: int) -> None:
        cur = self._read_counters()
        gen = (cur[1] if cur else 0) + 1
        os.pwrite(self._lock_fd, _LOCK_FMT.pack(_LOCK_MAGIC, max(0, used), gen), 0)
        self._my_gen = gen

    def _adjust_used(self, delta: int) -> None:
        cur = self._read_counters()
        if cur is None:
            self._rescan_locked()
            cur = self._read_counters()
        self._write_counters(cur[0] + delta)

    def used_bytes(self) -> int:
        """Bytes of all files in the folder (all processes), per the shared counter."""
        with self._locked():
            cur = self._read_counters()
            if cur is None:
                self._rescan_locked()
                cur = self._read_counters()
            return cur[0]

    def disk_bytes(self) -> int:
        """Bytes of all chunk and temp files, measured now by a scan (no side effects)."""
        total = 0
        for sub in self._subdirs():
            for e in self._entries(sub):
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass
        return total

    # ----- scanning ------------------------------------------------------------------
    def _subdirs(self) -> list[str]:
        try:
            return [e.path for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    @staticmethod
    def _entries(sub: str) -> list:
        try:
            return [e for e in os.scandir(sub) if FINAL_RE.match(e.name) or TMP_RE.match(e.name)]
        except FileNotFoundError:
            return []

    def _tmp_is_stale(self, m: re.Match, mtime: float, now: float) -> bool:
        if now - mtime > self.opts.stale_tmp_s:
            return True
        if m.group(2) == _HOST:
            pid = int(m.group(3))
            if pid == os.getpid():
                return m.group(1) not in self._writing
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False

    def _rescan_locked(self) -> None:
        """Rebuild the index and the shared used-bytes counter from the folder (lock held)."""
        now = time.time()
        found: list[tuple[float, str, int]] = []
        used = 0
        for sub in self._subdirs():
            for e in self._entries(sub):
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                tm = TMP_RE.match(e.name)
                if tm is not None:
                    if self._tmp_is_stale(tm, st.st_mtime, now):
                        Path(e.path).unlink(missing_ok=True)
                        logger.info("fastckpt kv: removed stale temp file %s (%d bytes)", e.path, st.st_size)
                        continue
                    used += st.st_size
                    continue
                used += st.st_size
                found.append((st.st_mtime, e.name[:32], st.st_size))
        recency = {n: i for i, n in enumerate(self._index)}
        found.sort(key=lambda t: (recency.get(t[1], -1), t[0]))  # unseen files first, oldest first
        self._index = OrderedDict((n, size) for _, n, size in found)
        self._write_counters(used)
        self._last_scan = time.monotonic()
        self.stats.add(rescans=1)

    def rescan(self) -> None:
        """Rebuild the index and the shared counter from the folder now."""
        with self._locked():
            self._rescan_locked()

    def names(self) -> list[str]:
        """Chunk names this process knows of, least recently used first."""
        with self._tlock:
            return list(self._index)

    # ----- lookup, pins, removal -------------------------------------------------------
    def contains(self, name: str) -> bool:
        """True if chunk ``name`` is committed (one ``stat``; sees other processes' puts)."""
        try:
            size = os.stat(self.path_for(name)).st_size
        except FileNotFoundError:
            with self._tlock:
                self._index.pop(name, None)
            return False
        with self._tlock:
            if name not in self._index:
                self._index[name] = size
        return True

    def is_writing(self, name: str) -> bool:
        """True while this process is writing chunk ``name``."""
        with self._tlock:
            return name in self._writing

    def pin(self, name: str) -> None:
        """Protect ``name`` from this process's evictions until :meth:`unpin`."""
        with self._tlock:
            self._pins[name] = self._pins.get(name, 0) + 1

    def unpin(self, name: str) -> bool:
        """Undo one :meth:`pin`; False if ``name`` was not pinned."""
        with self._tlock:
            n = self._pins.get(name, 0)
            if n <= 1:
                self._pins.pop(name, None)
            else:
                self._pins[name] = n - 1
            return n > 0

    def touch(self, name: str) -> None:
        """Mark ``name`` most recently used."""
        with self._tlock:
            if name in self._index:
                self._index.move_to_end(name)

    def remove(self, name: str, ino: int | None = None) -> bool:
        """Delete chunk ``name`` (only if its inode is ``ino``, when given); True if deleted."""
        path = self.path_for(name)
        with self._locked():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self._index.pop(name, None)
                return False
            if ino is not None and st.st_ino != ino:
                return False
            Path(path).unlink(missing_ok=True)
            recorded = self._index.pop(name, None)
            if recorded != st.st_size:
                self._rescan_locked()  # changed behind our back: recount from the folder
            else:
                self._adjust_used(-st.st_size)
            return True

    def drop_corrupt(self, handle: ChunkHandle, why: str) -> None:
        """Delete a chunk that failed validation (a miss from now on) and log ``why``."""
        logger.warning("fastckpt kv: dropping %s: %s", handle.path if handle else "?", why)
        self.stats.add(corrupt_dropped=1)
        if handle is not None:
            self.remove(handle.name, handle.ino)

    # ----- capacity ----------------------------------------------------------------------
    def _make_room_locked(self, need: int) -> None:
        """Evict LRU chunks until ``need`` more bytes fit (lock held).

        Raises:
            InsufficientSpaceError: ``need`` exceeds the capacity, or pinned and
                in-flight chunks leave too little evictable space.
        """
        cap = self.opts.max_bytes
        if cap == 0:
            return
        if need > cap:
            raise InsufficientSpaceError(
                f"{self.root}: a {need}-byte chunk exceeds the capacity of {cap} bytes; raise max_bytes")
        used = self._read_counters()[0]
        if used + need <= cap:
            return
        if time.monotonic() - self._last_scan >= self.opts.min_rescan_interval_s:
            self._rescan_locked()
            used = self._read_counters()[0]
        for attempt in range(2):
            for name in list(self._index):
                if used + need <= cap:
                    return
                if self._pins.get(name) or name in self._writing:
                    continue
                size = self._index.pop(name)  # what the shared counter holds for it
                path = self.path_for(name)
                try:
                    disk = os.stat(path).st_size  # smaller if someone truncated it
                    os.unlink(path)
                    self.stats.add(evictions=1, evicted_bytes=disk)
                except FileNotFoundError:
                    pass  # removed by someone else: its bytes are gone too
                used -= size
                self._write_counters(used)
            if used + need <= cap or attempt:
                break
            self._rescan_locked()  # other processes' chunks are unknown to the index
            used = self._read_counters()[0]
        if used + need > cap:
            raise InsufficientSpaceError(
                f"{self.root}: {need} bytes do not fit: {used} of {cap} bytes used and the rest is "
                "pinned or being written; raise max_bytes or lower the request's working set")

    def close(self) -> None:
        """Close the lock file; the store must not be used afterwards."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
