"""A folder of KV-cache chunk files shared by several processes (no LMCache import).

This is the storage half of the fastckpt LMCache backend (:mod:`fastckpt.integrations.lmcache.backend`
is the LMCache half). It is usable on its own, e.g. by ``benchmarks/bench_kv.py``.

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
      shared by all processes through the lock file. Every file creation, rename and
      unlink happens under the lock and adds exactly the size change it made, so the
      counter equals the folder's bytes at every lock release; it is re-derived by a
      scan on start, before eviction (at most once per ``min_rescan_interval_s``),
      after any anomaly (size changed behind our back) and after a process died inside
      the lock (see the protocol in :mod:`.folder_index`).

What lives where: this module writes and reads chunk files (:class:`KVFileStore`:
``write``, ``open_chunk``, ``read_piece``, ``close_chunk``), through the storage layer's
primitives (:class:`fastckpt.storage.FileWriter`: preallocation, O_DIRECT for aligned
buffers, fsync; :func:`fastckpt.storage.read_exact`; :func:`fastckpt.storage.fsync_dir`).
Its base class :class:`~.folder_index.KVFolderIndex` (:mod:`.folder_index`) holds the lock
file and shared counters, the folder scan, the LRU index, pins, removal, eviction and the
temp-file names. Options, stats, the chunk handle and ``chunk_name`` are in
:mod:`.chunk`; :mod:`fastckpt.kv` names the public ones.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from typing import Callable

import xxhash

from fastckpt.errors import CorruptCheckpointError
from fastckpt.format import encode_header
from fastckpt.storage.model_files import read_header_fd
from fastckpt.storage import ALIGN, FileWriter, buffer_address, fsync_dir, get_backend, read_exact
from fastckpt.storage.store import LOCAL

from .chunk import FORMAT_TAG, HEADER_ALIGN, ChunkHandle, KVStoreOptions, chunk_groups, chunk_name, piece_hashes
from .folder_index import KVFolderIndex

logger = logging.getLogger("fastckpt.kv")


class KVFileStore(KVFolderIndex):
    """Chunk files under one shared folder, with a shared capacity limit.

    Thread-safe; several processes (on one or several hosts) may open the same
    folder. Pins and recency are per process; capacity and files are shared.

    Args:
        options: see :class:`KVStoreOptions`.
        on_remove: called with a chunk's name after this process deleted its file (an LRU eviction
            for a put, an eviction for the tier's shared budget, a chunk dropped as corrupt, a
            :meth:`remove`), with the folder's lock held: keep it short (append to a list). Default None.

    Raises:
        OSError: the folder cannot be created or the lock file opened.
    """

    def __init__(self, options: KVStoreOptions, *, on_remove: Callable[[str], None] | None = None):
        self._direct_ok = options.o_direct and hasattr(os, "O_DIRECT")
        self._be = get_backend(None)
        super().__init__(options, on_remove=on_remove)
        self._write_ended = threading.Condition(self._tlock)  # a write of this process ended (see write)

    # ----- writing -------------------------------------------------------------------------
    def write(self, name: str, key: str, fmt: str, groups: list, buf: memoryview) -> bool:
        """Write one chunk atomically; return False if it already exists.

        A write of the same chunk by another thread of this process is waited for first: then the
        chunk exists (False), or that write failed and this one writes it. (Returning False at once
        told a second LMCache store task of the key it was stored while the first was still
        writing, or had failed: a key reported stored and never written.)

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
            while name in self._writing:
                self._write_ended.wait()
            self._writing.add(name)
        try:
            if LOCAL.exists(self.path_for(name)):
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
                self._write_ended.notify_all()
        self.stats.add(puts=1, put_bytes=len(buf), put_s=time.perf_counter() - t0)
        return True

    def _write_file(self, name: str, prefix: bytes, buf: memoryview) -> None:
        total = len(prefix) + len(buf)
        sub = os.path.join(self.root, name[:2])
        LOCAL.makedirs(sub)
        tmp = self.temp_path_for(name)
        with self._locked():  # make room and create the full-size temp file in one lock section
            self._make_room_locked(total)
            claim = self._tier.reserve_kv(total, self.evict_locked)  # the tier's shared budget; KV yields
            w = None
            try:  # creates the file and reserves its bytes: a full tier fails here, before any write
                w = FileWriter(self._be, tmp, total, o_direct=self._direct_ok)
                if self._be.size(w.fd) < total:  # no posix_fallocate here: the size is fixed now anyway
                    self._be.set_size(w.fd, total)
                size = self._be.size(w.fd)
            except BaseException:
                if w is not None:
                    w.close()
                LOCAL.remove(tmp)
                claim.release()
                raise
            self._adjust_used(size)  # the data writes below stay inside this size: no lock needed
            claim.release()  # now counted in this folder's stored bytes
        committed = False
        try:
            try:
                w.write(memoryview(prefix), 0)
                self._write_data(w, buf, len(prefix))
                if self.opts.durable:
                    w.sync()
            finally:
                w.close()
            final = self.path_for(name)
            with self._locked():
                if LOCAL.exists(final):  # same key committed meanwhile by another process
                    self._discard_temp_locked(tmp)
                else:
                    LOCAL.rename(tmp, final)  # FileNotFoundError if a scan judged our temp file stale
                    self._index[name] = size
                committed = True
            if self.opts.durable:
                fsync_dir(sub)
        finally:
            if not committed:
                with self._locked():
                    self._discard_temp_locked(tmp)

    def _discard_temp_locked(self, tmp: str) -> None:
        """Delete our temp file and subtract its bytes, if it is still there (lock held)."""
        try:
            size = LOCAL.entry(tmp).size
        except FileNotFoundError:
            return  # a scan removed it (stale) and recounted: nothing left to subtract
        if not LOCAL.remove(tmp):
            return
        self._adjust_used(-size)

    def _write_data(self, w: FileWriter, buf: memoryview, offset: int) -> None:
        """Write the chunk's data region (O_DIRECT for its aligned part when ``buf`` is aligned)."""
        w.write(buf, offset)

    # ----- reading -------------------------------------------------------------------------
    def open_chunk(self, name: str) -> ChunkHandle | None:
        """Open and validate chunk ``name``; None on a miss (a corrupt file is dropped).

        The caller must :meth:`close_chunk` a returned handle.
        """
        path = self.path_for(name)
        try:
            fd = self._be.open_read(path)
        except FileNotFoundError:
            with self._tlock:
                self._index.pop(name, None)
            return None
        except OSError as e:  # EIO, ESTALE on a network tier, EACCES: a miss, the file kept
            logger.warning("fastckpt kv: cannot open %s (%s): a miss", path, e)
            return None
        try:
            h = self._parse(fd, name, path)
        except Exception as e:  # noqa: BLE001 - any header that does not parse as ours is a bad file: a miss
            ino = self._be.inode(fd)
            self._be.close(fd)
            bad = e if isinstance(e, OSError) else CorruptCheckpointError(str(e), path=path)  # a read error keeps it
            self.read_failed(ChunkHandle(name, path, -1, -1, 0, [], 0, "", "", 1, [], ino), bad)
            return None
        if self._direct_ok:
            try:
                h.fd_direct = self._be.open_read(path, o_direct=True)
            except OSError:
                h.fd_direct = -1  # file system without O_DIRECT (tmpfs): buffered reads
        self._tier.begin_read(kv=True)  # a get is latency-critical: checkpoint writes are paced until close_chunk
        return h

    def _parse(self, fd: int, name: str, path: str) -> ChunkHandle:
        hdr = read_header_fd(fd, path)
        meta = hdr.metadata or {}
        if meta.get("format") != FORMAT_TAG:
            raise CorruptCheckpointError(f"{path}: format tag {meta.get('format')!r} != {FORMAT_TAG!r}", path=path)
        if chunk_name(meta["key"]) != name:
            raise CorruptCheckpointError(f"{path}: holds key {meta['key']!r}, not chunk {name}", path=path)
        nbytes = hdr.file_size - hdr.data_offset
        piece = int(meta["piece_bytes"])
        hashes = json.loads(meta["xxh3_64"])
        if piece <= 0 or len(hashes) != -(-nbytes // piece):
            raise CorruptCheckpointError(f"{path}: {len(hashes)} checksums for {nbytes} bytes", path=path)
        groups = chunk_groups(hdr.tensors, nbytes, path)
        return ChunkHandle(name, path, fd, -1, hdr.data_offset, groups, nbytes, meta["fmt"], meta["key"],
                           piece, hashes, self._be.inode(fd))

    def read_piece(self, h: ChunkHandle, buf: memoryview, start: int, length: int) -> None:
        """Read data bytes ``[start, start+length)`` of ``h`` into ``buf[start:start+length]``.

        Raises:
            CorruptCheckpointError: the file ends early or a checksum does not match (the file is bad).
            OSError: from the reads (EIO...).
        """
        mv = buf[start:start + length]
        off = h.data_offset + start
        what = f"data bytes [{start}, {start + length}) of {h.nbytes}"
        aligned = (length // ALIGN) * ALIGN
        done = 0
        if h.fd_direct >= 0 and aligned and off % ALIGN == 0 and buffer_address(mv) % ALIGN == 0:
            try:
                read_exact(self._be, h.fd_direct, mv[:aligned], off, path=h.path, what=what)
                done = aligned
            except OSError as e:  # the file system refused this direct read: go buffered
                if e.errno != errno.EINVAL:
                    raise
        if done < length:
            read_exact(self._be, h.fd, mv[done:], off + done, path=h.path, what=what)
        if self.opts.verify:
            i = start // h.piece_bytes
            if xxhash.xxh3_64_hexdigest(mv) != h.piece_hashes[i]:
                raise CorruptCheckpointError(f"{h.path}: checksum mismatch in piece {i} (data bytes "
                                             f"[{start}, {start + length}))", path=h.path)

    def close_chunk(self, h: ChunkHandle) -> None:
        """Close the descriptors of ``h``."""
        if h.fd >= 0:
            self._tier.end_read(h.nbytes, kv=True)
        for fd in (h.fd, h.fd_direct):
            if fd >= 0:
                self._be.close(fd)
        h.fd = h.fd_direct = -1
