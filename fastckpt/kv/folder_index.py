"""The shared half of :class:`~.file_store.KVFileStore`: lock, counters, index, eviction.

:class:`KVFolderIndex` is the base class of ``KVFileStore``. It owns what several processes
share through the folder, and this process's view of it, but never a chunk's contents:

* ``.fckv.lock``: the flock(2) lock (re-entrant per thread) and the shared header stored in
  it (used bytes, generation, the pid of the process inside the lock);
* the folder scan that rebuilds both (and removes stale temp files of dead writers);
* this process's LRU index of chunk names, its pins and its in-flight writes;
* lookup, removal (also of corrupt chunks) and LRU eviction down to ``max_bytes``.

Writing and reading chunk files is in :mod:`.file_store`, which also describes the folder
layout and the rules (case C8); options, stats and handles are in :mod:`.chunk`.
No LMCache import.

The accounting protocol (what keeps the shared capacity exact across processes):

1. **What is counted**: ``used`` is the sum of ``st_size`` of every chunk and temp file in the
   folder. It is a cache of a scan (:meth:`KVFolderIndex.rescan` re-derives it), never a
   ledger of intentions.
2. **When, under which lock**: every change of a file's existence or size in the folder
   (create + preallocate a temp file, rename, unlink) happens inside the flock, and the same
   lock section then adds exactly the delta it caused: the ``st_size`` of the file it created,
   or the ``st_size`` (``stat`` just before) of the file its own ``unlink`` removed. An
   ``unlink`` that finds nothing (another process got there first) subtracts nothing. Writing
   the data into a preallocated temp file changes no size and needs no lock.
3. **Capacity**: a put makes room (evicts) and creates its full-size temp file in one lock
   section, so ``used + need <= max_bytes`` holds before any byte appears: the folder never
   exceeds ``max_bytes`` (in-flight temp files included), with every process using the same
   ``max_bytes``.
4. **Crashes**: entering the lock writes this pid into the header, leaving clears it. A
   process killed inside the lock leaves its pid there; the next process to take the lock
   sees it and recounts by a scan before doing anything else. A process killed outside the
   lock leaves only a temp file, which is counted (it occupies bytes) until a scan finds its
   writer dead and deletes it (subtracting it by recounting).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable

from fastckpt.errors import CorruptCheckpointError, InsufficientSpaceError
from fastckpt.storage.commit import host_tag, pid_alive
from fastckpt.storage.lock import SharedStateFile
from fastckpt.storage.store import LOCAL
from fastckpt.storage.tier import tier_for

from .chunk import LOCK_NAME, SUFFIX, ChunkHandle, KVStats, KVStoreOptions

# one logger for the whole KV store (this module and file_store)
logger = logging.getLogger("fastckpt.kv")

#: ``.fckv.lock`` header: magic, used bytes, generation (bumped on every change), holder pid
#: (the process inside the lock; 0 when it was left cleanly). An older or unknown header is
#: recounted by a scan.
_LOCK_FMT = struct.Struct("<8sQQQ")
_LOCK_MAGIC = b"FCKVLCK2"
#: Name of a committed chunk file (group 1: the chunk name).
FINAL_RE = re.compile(r"^([0-9a-f]{32})\.kv\.safetensors$")
#: Name of a chunk file being written, ``.tmp.<chunk name>.<host>.<pid>.<hex>`` (never a hit;
#: groups: chunk name, host tag (:func:`fastckpt.storage.commit.host_tag`), pid).
#: :meth:`KVFolderIndex.temp_path_for` makes them.
TMP_RE = re.compile(r"^\.tmp\.([0-9a-f]{32})\.([^.]+)\.(\d+)\.[0-9a-f]+$")


def _read_lock_header(lock: SharedStateFile) -> tuple[int, int, int] | None:
    """``(used bytes, generation, holder pid)`` from an open ``.fckv.lock``; None if absent or unknown."""
    raw = lock.read(_LOCK_FMT.size)
    if len(raw) != _LOCK_FMT.size:
        return None
    magic, used, gen, holder = _LOCK_FMT.unpack(raw)
    return (used, gen, holder) if magic == _LOCK_MAGIC else None


def _folder_bytes(root: str) -> tuple[int, int, int]:
    """``(bytes, chunk files, temp files)`` of the chunk and temp files under ``root`` now."""
    total = chunks = temps = 0
    try:
        subs = [e.path for e in LOCAL.entries(root) if len(e.name) == 2 and e.folder]
    except FileNotFoundError:
        return 0, 0, 0
    for sub in subs:
        try:
            entries = LOCAL.entries(sub)
        except FileNotFoundError:
            continue
        for e in entries:
            final = FINAL_RE.match(e.name) is not None
            if not final and TMP_RE.match(e.name) is None:
                continue
            total += e.size
            chunks += final
            temps += not final
    return total, chunks, temps


def audit(root: str) -> dict:
    """The folder's accounting and its real bytes, read together under the folder lock.

    Touches nothing (no repair, no temp-file removal): a read-only check for tests and
    operators. Returns ``{"counter", "generation", "holder", "disk", "chunks", "temps"}``:
    ``counter`` is the shared used-bytes counter (None if the lock file has no valid header),
    ``holder`` the pid a process killed inside the lock left there (0 when clean), ``disk``
    the summed ``st_size`` of chunk and temp files. With ``holder == 0`` the protocol
    guarantees ``counter == disk``; otherwise the next lock section of any store recounts.
    """
    lock = SharedStateFile(os.path.join(root, LOCK_NAME), create=False)
    try:
        lock.lock()
        try:
            hdr = _read_lock_header(lock)
            disk, chunks, temps = _folder_bytes(root)
        finally:
            lock.unlock()
    finally:
        lock.close()
    return {"counter": hdr[0] if hdr else None, "generation": hdr[1] if hdr else None,
            "holder": hdr[2] if hdr else None, "disk": disk, "chunks": chunks, "temps": temps}


class KVFolderIndex:
    """Shared counters, index, pins and eviction of one KV chunk folder (base of ``KVFileStore``).

    Constructed through :class:`~.file_store.KVFileStore` (same argument, same errors):
    creates the folder, opens ``.fckv.lock`` and rebuilds the index and the shared
    used-bytes counter by a scan. The index, pins and in-flight set belong to this
    process (guarded by a thread lock); files and the counter are shared (guarded by
    the flock).
    """

    def __init__(self, options: KVStoreOptions, *, on_remove: Callable[[str], None] | None = None):
        self.opts = options
        self._on_remove = on_remove
        self.root = os.path.abspath(options.path)
        LOCAL.makedirs(self.root)
        self.stats = KVStats()
        self._tlock = threading.RLock()
        self._depth = 0
        self._lock = SharedStateFile(os.path.join(self.root, LOCK_NAME))
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> bytes, LRU first
        self._pins: dict[str, int] = {}
        self._writing: set[str] = set()
        self._last_scan = 0.0
        self._tier, self._published = tier_for(self.root), -1  # the tier's shared budget sees this folder's bytes
        with self._locked():
            self._rescan_locked()
        self._tier.add_evictor(self.evict_for_tier)  # KV evicts when checkpoints need the room

    # ----- paths and shared counters -------------------------------------------------
    def path_for(self, name: str) -> str:
        """Final path of chunk ``name``."""
        return os.path.join(self.root, name[:2], name + SUFFIX)

    def temp_path_for(self, name: str) -> str:
        """A fresh temporary path for writing chunk ``name`` in its sub-folder (see :data:`TMP_RE`:
        it names this host and process, so a scan can tell a dead writer's leftover)."""
        return os.path.join(self.root, name[:2], f".tmp.{name}.{host_tag()}.{os.getpid()}.{os.urandom(4).hex()}")

    def _locked(self):
        """The folder lock as a context manager (re-entrant in one thread).

        Taking it (depth 0 -> 1) opens a lock section: the header is read, recounted by a
        scan if a previous holder died inside the lock (its pid is still there) or the header
        is unreadable, and this pid is written into it. Leaving it clears the pid again, except
        when an exception other than :class:`InsufficientSpaceError` (raised only with the
        accounting settled) escapes the section: then the pid stays and the next section, of
        any process, recounts.
        """
        store = self

        class _Ctx:
            def __enter__(self):
                store._tlock.acquire()
                try:
                    if store._depth == 0:
                        store._lock.lock()
                        try:
                            store._open_section()
                        except BaseException:
                            store._lock.unlock()
                            raise
                    store._depth += 1
                except BaseException:
                    store._tlock.release()
                    raise

            def __exit__(self, et, ev, tb):
                try:
                    store._depth -= 1
                    if store._depth == 0:
                        try:
                            if et is None or issubclass(et, InsufficientSpaceError):
                                store._close_section()
                        finally:
                            store._lock.unlock()
                finally:
                    store._tlock.release()

        return _Ctx()

    def _open_section(self) -> None:
        hdr = _read_lock_header(self._lock)
        if hdr is None or hdr[2] != 0:
            if hdr is not None and hdr[2] == os.getpid():
                logger.info("fastckpt kv: %s: a lock section of this process ended by an error; "
                            "recounting the folder", self.root)
            elif hdr is not None:
                logger.warning("fastckpt kv: %s: process %d left the folder lock inside a change "
                               "(killed?); recounting the folder", self.root, hdr[2])
                self.stats.add(repairs=1)
            self._rescan_locked()  # writes a header holding this pid
        else:
            self._write_header(hdr[0], hdr[1])

    def _close_section(self) -> None:
        hdr = _read_lock_header(self._lock)
        if hdr is not None:
            self._lock.write(_LOCK_FMT.pack(_LOCK_MAGIC, hdr[0], hdr[1], 0))

    def _write_header(self, used: int, gen: int) -> None:
        self._lock.write(_LOCK_FMT.pack(_LOCK_MAGIC, max(0, used), gen, os.getpid()))
        if used != self._published:
            self._tier.publish("kv", self.root, max(0, used))
            self._published = used

    def _used_locked(self) -> int:
        """The shared used-bytes counter (lock held; valid: the section was opened by a check)."""
        hdr = _read_lock_header(self._lock)
        if hdr is None:  # clobbered by someone outside the protocol
            self._rescan_locked()
            hdr = _read_lock_header(self._lock)
        return hdr[0]

    def _adjust_used(self, delta: int) -> None:
        """Add ``delta``, the size change this section itself just made in the folder (lock held).

        Called after the change: if the header is unreadable, the recount already sees it.
        """
        hdr = _read_lock_header(self._lock)
        if hdr is None:
            self._rescan_locked()
            return
        self._write_header(hdr[0] + delta, hdr[1] + 1)

    def used_bytes(self) -> int:
        """Bytes of all files in the folder (all processes), per the shared counter."""
        with self._locked():
            return self._used_locked()

    def disk_bytes(self) -> int:
        """Bytes of all chunk and temp files, measured now by a scan (no lock, no side effects)."""
        return _folder_bytes(self.root)[0]

    # ----- scanning ------------------------------------------------------------------
    def _subdirs(self) -> list[str]:
        try:
            return [e.path for e in LOCAL.entries(self.root) if len(e.name) == 2 and e.folder]
        except FileNotFoundError:
            return []

    @staticmethod
    def _entries(sub: str) -> list:
        try:
            return [e for e in LOCAL.entries(sub) if FINAL_RE.match(e.name) or TMP_RE.match(e.name)]
        except FileNotFoundError:
            return []

    def _tmp_is_stale(self, m: re.Match, mtime: float, now: float) -> bool:
        """A temp file of this host is stale when its writer is gone (this process: not being
        written; another: its pid dead or reused), whatever its age: a live writer's file is never
        deleted, however slow its write. Another host's (a shared network tier) when older than
        ``stale_tmp_s``: its writer cannot be asked."""
        if m.group(2) == host_tag():
            pid = int(m.group(3))
            if pid == os.getpid():
                return m.group(1) not in self._writing
            return not pid_alive(pid, mtime)  # its writer started before it was last written
        return now - mtime > self.opts.stale_tmp_s

    def _rescan_locked(self) -> None:
        """Rebuild the index and re-derive the shared used-bytes counter from the folder (lock held).

        Deletes stale temp files first (:meth:`_tmp_is_stale`); what remains is counted.
        """
        now = time.time()
        found: list[tuple[float, str, int]] = []
        used = 0
        for sub in self._subdirs():
            for e in self._entries(sub):
                tm = TMP_RE.match(e.name)
                if tm is not None:
                    if self._tmp_is_stale(tm, e.mtime, now):
                        LOCAL.remove(e.path)
                        logger.info("fastckpt kv: removed stale temp file %s (%d bytes)", e.path, e.size)
                        continue
                    used += e.size
                    continue
                used += e.size
                found.append((e.mtime, e.name[:32], e.size))
        recency = {n: i for i, n in enumerate(self._index)}
        found.sort(key=lambda t: (recency.get(t[1], -1), t[0]))  # unseen files first, oldest first
        self._index = OrderedDict((n, size) for _, n, size in found)
        hdr = _read_lock_header(self._lock)
        self._write_header(used, (hdr[1] if hdr else 0) + 1)
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
            size = LOCAL.size(self.path_for(name))
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
        """Delete chunk ``name`` (only if its inode is ``ino``, when given); True if this call deleted it.
        This process's pins of it go with it (a chunk put again under the name starts unpinned)."""
        with self._locked():
            gone = self._unlink_chunk_locked(name, ino) is not None
            if gone:
                self._pins.pop(name, None)
            return gone

    def _unlink_chunk_locked(self, name: str, ino: int | None = None) -> int | None:
        """Delete chunk ``name`` and subtract exactly the bytes this unlink removed (lock held).

        Returns those bytes, or None if the file was already gone (someone else removed it and
        subtracted it: nothing to subtract here) or is not inode ``ino``. A size other than the
        one the index recorded means someone outside the protocol changed the file: recount.
        """
        path = self.path_for(name)
        recorded = self._index.get(name)
        try:
            st = LOCAL.entry(path)
        except FileNotFoundError:
            self._index.pop(name, None)
            return None
        if ino is not None and st.ino != ino:
            return None
        if not LOCAL.remove(path):
            self._index.pop(name, None)
            return None
        self._index.pop(name, None)
        if recorded is not None and recorded != st.size:
            self._rescan_locked()  # changed behind our back: re-derive from the folder
        else:
            self._adjust_used(-st.size)
        if self._on_remove is not None:
            self._on_remove(name)
        return st.size

    def read_failed(self, handle: ChunkHandle, err: BaseException) -> None:
        """A read of ``handle`` failed: a bad file (:class:`CorruptCheckpointError`: short, bad header,
        checksum) is dropped (:meth:`drop_corrupt`); any other error (EIO, ESTALE on a network tier) is a
        miss this time and the file is kept for every process sharing the folder (it was deleted)."""
        if isinstance(err, CorruptCheckpointError):
            self.drop_corrupt(handle, str(err))
        else:
            logger.warning("fastckpt kv: reading %s failed (%s: %s): a miss; the file is kept",
                           handle.path if handle else "?", type(err).__name__, err)

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
        used = self._used_locked()
        if used + need <= cap:
            return
        rescanned = False
        if time.monotonic() - self._last_scan >= self.opts.min_rescan_interval_s:
            self._rescan_locked()
            rescanned = True
            used = self._used_locked()
        while True:
            for name in list(self._index):
                if used + need <= cap:
                    return
                if self._pins.get(name) or name in self._writing:
                    continue
                freed = self._unlink_chunk_locked(name)
                if freed is not None:
                    self.stats.add(evictions=1, evicted_bytes=freed)
                used = self._used_locked()  # what the folder holds now, other processes' changes included
            if used + need <= cap or rescanned:
                break
            self._rescan_locked()  # other processes' chunks are unknown to the index
            rescanned = True
            used = self._used_locked()
        if used + need > cap:
            raise InsufficientSpaceError(
                f"{self.root}: {need} bytes do not fit: {used} of {cap} bytes used and the rest is "
                "pinned or being written; raise max_bytes or lower the request's working set")

    def evict_locked(self, nbytes: int) -> int:
        """Evict least recently used chunks (not pinned, not being written) until ``nbytes`` are
        freed (lock held); returns the bytes freed. Rescans once when this process knows too few."""
        freed, rescanned = 0, False
        while freed < nbytes:
            for name in list(self._index):
                if freed >= nbytes:
                    break
                if self._pins.get(name) or name in self._writing:
                    continue
                got = self._unlink_chunk_locked(name)
                if got is not None:
                    freed += got
                    self.stats.add(evictions=1, evicted_bytes=got)
            if freed >= nbytes or rescanned:
                break
            self._rescan_locked()  # other processes' chunks are unknown to the index
            rescanned = True
        return freed

    def evict_for_tier(self, nbytes: int) -> int:
        """Evict about ``nbytes`` for the tier's budget (the tier arbiter calls it while a checkpoint
        or model needs room); returns the bytes freed."""
        with self._locked():
            return self.evict_locked(nbytes)

    def close(self) -> None:
        """Close the lock file; the store must not be used afterwards."""
        self._tier.remove_evictor(self.evict_for_tier)
        self._lock.close()
