"""A folder of KV-cache chunk files shared by several processes (no LMCache import).

This is the storage half of the fastckpt LMCache backend (:mod:`.lmcache` is the
LMCache half). It is usable on its own, e.g. by ``benchmarks/bench_kv.py``.

Layout under ``root``::

    .fckv.lock                  flock(2) lock + shared counters (used bytes, generation)
    ab/<32 hex>.kv.safetensors  one committed chunk; "ab" = first two hex digits
    ab/.tmp.<32 hex>.<host>.<pid>.<rand>   a chunk being written (never a hit)

Each chunk is a standard safetensors file (readable by the ``safetensors`` package):
one tensor per KV group (``kv.0``, ``kv.1`` ...), the header padded to 4096 bytes
so the data region can be read with O_DIRECT, and ``__metadata__`` holding the
format tag, the LMCache key string, the memory format, and one xxh3-64 checksum
per ``piece_bytes`` piece of the data region.

Rules (case C8 of ``shared/cases``):
    * A chunk becomes visible only by ``rename(2)`` of a complete, fsynced temp file.
    * Space is reserved (``posix_fallocate``) before any byte is written, so a full
      tier fails the put up front; a failed put leaves nothing behind.
    * A file that is short, has a bad header, or fails its checksum is a miss and
      is deleted.
    * ``used_bytes`` counts every file in the folder (committed and temp); it is
      shared by all processes through the lock file and recomputed from a scan on
      start, before eviction (at most once per ``min_rescan_interval_s``) and after
      any anomaly (file gone, size changed).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections import OrderedDict

import xxhash

from fastckpt.errors import CorruptCheckpointError, InsufficientSpaceError
from fastckpt.format import encode_header, read_header_fd

from .lmcache_format import (  # noqa: F401  (re-exported: the store's public types)
    FORMAT_TAG, HEADER_ALIGN, LOCK_NAME, SUFFIX, ChunkHandle, KVStats, StoreOptions, _address,
    _fsync_dir, _pread_into, _pwrite_all, _unlink_quiet, chunk_name, piece_hashes,
)

logger = logging.getLogger(__name__)

_LOCK_FMT = struct.Struct("<8sQQ")
_LOCK_MAGIC = b"FCKVLCK1"
_FINAL_RE = re.compile(r"^([0-9a-f]{32})\.kv\.safetensors$")
_TMP_RE = re.compile(r"^\.tmp\.([0-9a-f]{32})\.([^.]+)\.(\d+)\.[0-9a-f]+$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


class KVFileStore:
    """Chunk files under one shared folder, with a shared capacity limit.

    Thread-safe; several processes (on one or several hosts) may open the same
    folder. Pins and recency are per process; capacity and files are shared.

    Args:
        options: see :class:`StoreOptions`.

    Raises:
        OSError: the folder cannot be created or the lock file opened.
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
        self._direct_ok = options.o_direct and hasattr(os, "O_DIRECT")
        with self._locked():
            self._rescan_locked()

    # ----- paths and shared counters -------------------------------------------------
    def path_for(self, name: str) -> str:
        """Final path of chunk ``name``."""
        return os.path.join(self.root, name[:2], name + SUFFIX)

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
            return [e for e in os.scandir(sub) if _FINAL_RE.match(e.name) or _TMP_RE.match(e.name)]
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
                tm = _TMP_RE.match(e.name)
                if tm is not None:
                    if self._tmp_is_stale(tm, st.st_mtime, now):
                        _unlink_quiet(e.path)
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
            _unlink_quiet(path)
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

    # ----- writing -------------------------------------------------------------------------
    def write(self, name: str, key: str, fmt: str, groups: list, buf: memoryview) -> bool:
        """Write one chunk atomically; return False if it already exists or is being written.

        Args:
            name: :func:`chunk_name` of ``key``.
            key: LMCache key string, stored in the metadata.
            fmt: LMCache memory-format name (e.g. ``"KV_2LTD"``).
            groups: ``[(safetensors dtype, shape, nbytes)]``; their bytes lie back to
                back in ``buf``.
            buf: the chunk's bytes (a C-contiguous byte view).

        Raises:
            InsufficientSpaceError: the capacity cannot be met (see ``_make_room_locked``).
            OSError: the tier is full (ENOSPC at reservation) or another I/O error;
                nothing stays behind.
        """
        t0 = time.perf_counter()
        with self._tlock:
            if name in self._writing:
                return False
            self._writing.add(name)
        try:
            if os.path.exists(self.path_for(name)):
                self.stats.add(put_skipped=1)
                return False
            entries = [(f"kv.{i}", dt, tuple(shape), nb) for i, (dt, shape, nb) in enumerate(groups)]
            meta = {"format": FORMAT_TAG, "key": key, "fmt": fmt, "piece_bytes": str(self.opts.piece_bytes),
                    "xxh3_64": json.dumps(piece_hashes(buf, self.opts.piece_bytes))}
            prefix, _ = encode_header(entries, meta, align=HEADER_ALIGN)
            self._write_file(name, prefix, buf)
        except BaseException:
            self.stats.add(put_failures=1)
            raise
        finally:
            with self._tlock:
                self._writing.discard(name)
        self.stats.add(puts=1, put_bytes=len(buf), put_s=time.perf_counter() - t0)
        return True

    def _write_file(self, name: str, prefix: bytes, buf: memoryview) -> None:
        total = len(prefix) + len(buf)
        sub = os.path.join(self.root, name[:2])
        os.makedirs(sub, exist_ok=True)
        tmp = os.path.join(sub, f".tmp.{name}.{_HOST}.{os.getpid()}.{os.urandom(4).hex()}")
        with self._locked():
            self._make_room_locked(total)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            self._adjust_used(total)
        committed = False
        try:
            try:
                _pwrite_all(fd, memoryview(prefix), 0)
                self._write_data(fd, tmp, buf, len(prefix))
                if self.opts.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            final = self.path_for(name)
            with self._locked():
                if os.path.exists(final):  # same key committed meanwhile by another process
                    _unlink_quiet(tmp)
                    self._adjust_used(-total)
                else:
                    os.rename(tmp, final)
                    self._index[name] = total
                committed = True
            if self.opts.durable:
                _fsync_dir(sub)
        finally:
            if not committed:
                _unlink_quiet(tmp)
                with self._locked():
                    self._adjust_used(-total)

    def _write_data(self, fd: int, path: str, buf: memoryview, offset: int) -> None:
        aligned = (len(buf) // 4096) * 4096
        if self._direct_ok and aligned and offset % 4096 == 0 and _address(buf) % 4096 == 0:
            try:
                dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
                try:
                    _pwrite_all(dfd, buf[:aligned], offset)
                finally:
                    os.close(dfd)
                _pwrite_all(fd, buf[aligned:], offset + aligned)
                return
            except OSError as e:  # no O_DIRECT here (tmpfs...): write buffered instead
                if e.errno != errno.EINVAL:
                    raise
        _pwrite_all(fd, buf, offset)

    # ----- reading -------------------------------------------------------------------------
    def open_chunk(self, name: str) -> ChunkHandle | None:
        """Open and validate chunk ``name``; None on a miss (a corrupt file is dropped).

        The caller must :meth:`close_chunk` a returned handle.
        """
        path = self.path_for(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self._tlock:
                self._index.pop(name, None)
            return None
        try:
            h = self._parse(fd, name, path)
        except (CorruptCheckpointError, ValueError, KeyError, OSError) as e:
            ino = os.fstat(fd).st_ino
            os.close(fd)
            self.drop_corrupt(ChunkHandle(name, path, -1, -1, 0, [], 0, "", "", 1, [], ino), str(e))
            return None
        if self._direct_ok:
            try:
                h.fd_direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                h.fd_direct = -1  # file system without O_DIRECT (tmpfs): buffered reads
        return h

    def _parse(self, fd: int, name: str, path: str) -> ChunkHandle:
        hdr = read_header_fd(fd, path)
        meta = hdr.metadata or {}
        if meta.get("format") != FORMAT_TAG:
            raise CorruptCheckpointError(f"{path}: format tag {meta.get('format')!r} != {FORMAT_TAG!r}", path=path)
        if chunk_name(meta["key"]) != name:
            raise CorruptCheckpointError(f"{path}: holds key {meta['key']!r}, not chunk {name}", path=path)
        infos = list(hdr.tensors.values())
        nbytes = hdr.file_size - hdr.data_offset
        piece = int(meta["piece_bytes"])
        hashes = json.loads(meta["xxh3_64"])
        if piece <= 0 or len(hashes) != -(-nbytes // piece):
            raise CorruptCheckpointError(f"{path}: {len(hashes)} checksums for {nbytes} bytes", path=path)
        groups = [(i.dtype, i.shape) for i in sorted(infos, key=lambda i: int(i.name.split(".")[1]))]
        return ChunkHandle(name, path, fd, -1, hdr.data_offset, groups, nbytes, meta["fmt"], meta["key"],
                           piece, hashes, os.fstat(fd).st_ino)

    def read_piece(self, h: ChunkHandle, buf: memoryview, start: int, length: int) -> None:
        """Read data bytes ``[start, start+length)`` of ``h`` into ``buf[start:start+length]``.

        Raises:
            CorruptCheckpointError: short read or checksum mismatch (the file is bad).
        """
        mv = buf[start:start + length]
        off = h.data_offset + start
        aligned = (length // 4096) * 4096
        done = 0
        if h.fd_direct >= 0 and aligned and off % 4096 == 0 and _address(mv) % 4096 == 0:
            try:
                done = _pread_into(h.fd_direct, mv[:aligned], off)
            except OSError as e:  # the file system refused this direct read: go buffered
                if e.errno != errno.EINVAL:
                    raise
                done = 0
        if done == aligned or done == 0:
            done += _pread_into(h.fd, mv[done:], off + done)
        if done != length:
            raise CorruptCheckpointError(f"{h.path}: short read at data byte {start + done} of {h.nbytes}",
                                         path=h.path)
        if self.opts.verify:
            i = start // h.piece_bytes
            if xxhash.xxh3_64_hexdigest(mv) != h.piece_hashes[i]:
                raise CorruptCheckpointError(f"{h.path}: checksum mismatch in piece {i} (data bytes "
                                             f"[{start}, {start + length}))", path=h.path)

    def close_chunk(self, h: ChunkHandle) -> None:
        """Close the descriptors of ``h``."""
        for fd in (h.fd, h.fd_direct):
            if fd >= 0:
                os.close(fd)
        h.fd = h.fd_direct = -1

    def close(self) -> None:
        """Close the lock file; the store must not be used afterwards."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
