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

What lives where: this module writes and reads chunk files (:class:`KVFileStore`:
``write``, ``open_chunk``, ``read_piece``, ``close_chunk``). Its base class
:class:`~.lmcache_index.KVFolderIndex` (:mod:`.lmcache_index`) holds the lock file and
shared counters, the folder scan, the LRU index, pins, removal and eviction. Options,
stats, the chunk handle, ``chunk_name`` and the I/O helpers are in :mod:`.lmcache_format`.
All of them stay importable from here.
"""

from __future__ import annotations

import errno
import json
import os
import time

import xxhash

from fastckpt.errors import CorruptCheckpointError
from fastckpt.format.safetensors import encode_header, read_header_fd

from .lmcache_format import (  # noqa: F401  (re-exported: the store's public types)
    FORMAT_TAG, HEADER_ALIGN, LOCK_NAME, SUFFIX, ChunkHandle, KVStats, StoreOptions, _address,
    _fsync_dir, _pread_into, _pwrite_all, _unlink_quiet, chunk_name, piece_hashes,
)
from .lmcache_index import (  # noqa: F401  (re-exported: the base class, its constants, the logger)
    _FINAL_RE, _HOST, _LOCK_FMT, _LOCK_MAGIC, _TMP_RE, KVFolderIndex, logger,
)


class KVFileStore(KVFolderIndex):
    """Chunk files under one shared folder, with a shared capacity limit.

    Thread-safe; several processes (on one or several hosts) may open the same
    folder. Pins and recency are per process; capacity and files are shared.

    Args:
        options: see :class:`StoreOptions`.

    Raises:
        OSError: the folder cannot be created or the lock file opened.
    """

    def __init__(self, options: StoreOptions):
        self._direct_ok = options.o_direct and hasattr(os, "O_DIRECT")
        super().__init__(options)

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
