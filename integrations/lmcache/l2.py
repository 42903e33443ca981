"""LMCache multiprocess (server) mode: an L2 adapter over the fastckpt KV chunk store.

LMCache 0.5.x's server keeps KV chunks in L1 (CPU memory) and moves them to and from L2
adapters (``lmcache.v1.distributed.l2_adapters``). Its ``plugin`` adapter type loads an
external class; this module is that class. Configure it with one ``--l2-adapter`` JSON
(see ``docs/KV.md``)::

    {"type": "plugin",
     "module_path": "fastckpt.integrations.lmcache.l2",
     "class_name": "FastCkptL2Adapter",
     "adapter_params": {"path": "/mnt/array/kv", "max_bytes": 107374182400}}

LMCache finds :class:`FastCkptL2AdapterConfig` by its name (class name + ``Config``) and
builds it from ``adapter_params`` (the options of the in-process plugin, same names, same
checks: ``path``, ``max_bytes``, ``o_direct``, ``durable``, ``piece_bytes``, ``verify``,
``min_rescan_interval_s``, ``stale_tmp_s``, ``read_threads``, ``write_threads``).

The chunks go to the same :class:`~fastckpt.kv.KVFileStore` as the in-process plugin
(:mod:`.lmcache`): same file format, same folder, one shared ``max_bytes`` for every process
and both modes, restart reuse (a new server serves what the folder holds), atomic commits
(a killed write never becomes a hit) and per-piece checksums (a chunk that fails them is a
miss and is deleted). An object's key is LMCache's own serialized ``ObjectKey`` (the string
its native connectors use), hashed to the file name like the in-process plugin's keys.

Contract (``L2AdapterInterface``): every ``submit_*`` returns at once; a small pool runs the
task and signals the store / lookup / load event fd when its result is ready. A lookup pins
the chunks it found against this process's evictions until ``submit_unlock``; a load reads
the task's chunks on ``read_threads`` threads straight into the caller's buffers, in spans of
:data:`SPAN_PIECES` pieces (one read call each, O_DIRECT where aligned), checking each piece's
checksum after its span is read. A store whose chunk does not fit (``max_bytes`` full of pinned or
in-flight chunks) fails its task (the L2 interface reports store results per task); the
typed :class:`fastckpt.errors.InsufficientSpaceError` is logged and kept in
``report_status()["last_store_error"]``. Chunks the store evicts to make room are reported to
LMCache's listeners as deleted.
"""

from __future__ import annotations

import difflib
import logging
import math
import dataclasses
import errno
import json
import mmap
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import _object_key_to_string
from lmcache.v1.platform import create_event_notifier

import xxhash

from fastckpt.errors import CorruptCheckpointError
from fastckpt.format import dtype_to_str, parse_header
from fastckpt.storage import ALIGN, buffer_address

from fastckpt.kv import ChunkHandle, KVFileStore, KVStoreOptions, chunk_name
from fastckpt.kv.chunk import FORMAT_TAG, HEADER_ALIGN, chunk_groups

from .config import OPTIONS

logger = logging.getLogger(__name__)

__all__ = ["FastCkptL2Adapter", "FastCkptL2AdapterConfig", "MODULE_PATH", "CLASS_NAME"]

MODULE_PATH = "fastckpt.integrations.lmcache.l2"
CLASS_NAME = "FastCkptL2Adapter"
#: Pieces read by one call (one ``preadv``; the kernel splits it into device requests, so one
#: read keeps several in flight, as LMCache's fs_native reads a whole file at once); each piece's
#: checksum is checked after the read. 8 x 4 MiB: a 32 MiB chunk is one read.
SPAN_PIECES = 8
#: ``adapter_params`` keys: the in-process plugin's options (its ``module_path``/``class_name`` are LMCache's).
PARAMS = [o for o in OPTIONS if o not in ("module_path", "class_name", "stats_log_interval_s")]


class FastCkptL2AdapterConfig(L2AdapterConfigBase):
    """Options of :class:`FastCkptL2Adapter`, built by LMCache from the plugin's ``adapter_params``.

    Args:
        store: the chunk store's :class:`~fastckpt.kv.KVStoreOptions` (``path`` required).
        read_threads: threads reading chunks (in spans of :data:`SPAN_PIECES` pieces) in parallel: the
            load depth. Default 16.
        write_threads: threads writing chunks of store tasks in parallel. Default 4.
    """

    def __init__(self, store: KVStoreOptions, read_threads: int = 16, write_threads: int = 4):
        self.store = store
        self.read_threads = read_threads
        self.write_threads = write_threads

    @classmethod
    def from_dict(cls, d: dict) -> "FastCkptL2AdapterConfig":
        """Parse ``adapter_params`` (the same option names and checks as the in-process plugin).

        Args:
            d: ``{"path": str, "max_bytes": int, ...}``; see :data:`PARAMS`.

        Raises:
            ValueError: ``d`` is not a mapping, ``path`` is missing, or a value is malformed
                (one line per bad key, naming it and the form expected).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{CLASS_NAME}: adapter_params must be a mapping, got {type(d).__name__}")
        vals, errs = {}, []
        for o in PARAMS:
            conv, default = OPTIONS[o]
            v = d.get(o)
            if v is None and o != "path":
                vals[o] = default
                continue
            try:
                vals[o] = conv(v, o)
            except ValueError as e:  # one line naming the key and the form expected
                errs.append(str(e).replace("extra_config ", f"{CLASS_NAME} adapter_params.", 1))
        if errs:
            raise ValueError("; ".join(errs))
        for k in d:
            if k not in PARAMS and k not in ("eviction", "serde", "persist_enabled", "shared"):
                near = next(iter(difflib.get_close_matches(str(k), PARAMS, n=1, cutoff=0.6)), None)
                logger.warning("fastckpt kv: %s adapter_params.%s: unknown option, ignored%s", CLASS_NAME, k,
                               f"; did you mean {near}?" if near else "")
        store = KVStoreOptions(path=vals["path"], max_bytes=vals["max_bytes"], o_direct=vals["o_direct"],
                             durable=vals["durable"], piece_bytes=vals["piece_bytes"], verify=vals["verify"],
                             min_rescan_interval_s=vals["min_rescan_interval_s"], stale_tmp_s=vals["stale_tmp_s"])
        return cls(store, read_threads=vals["read_threads"], write_threads=vals["write_threads"])

    @classmethod
    def help(cls) -> str:
        """One line per option, for LMCache's ``--help`` of plugin adapters."""
        return ("fastckpt KV L2 adapter (adapter_params): path (required, shared folder), max_bytes (int, "
                "whole folder, 0 = unlimited), o_direct, durable, verify (bool), piece_bytes (multiple of "
                "4096), min_rescan_interval_s, stale_tmp_s (seconds), read_threads, write_threads (int >= 1)")


class _WholeChunkStore(KVFileStore):
    """The chunk store, noting every chunk this process removed (to tell LMCache's listeners): LRU
    evictions for a put, evictions for the tier's shared budget (a checkpoint needing room), chunks
    dropped as corrupt, and deletes LMCache asked for (those it reports itself; see :meth:`take_removed`)."""

    def __init__(self, options: KVStoreOptions):
        self.removed: list[str] = []
        #: called after an eviction for the tier's budget, outside the store's lock (the adapter
        #: reports the chunks to LMCache's listeners then, not at its next task)
        self.after_tier_eviction: Callable[[], None] | None = None
        super().__init__(options, on_remove=self.removed.append)

    def evict_for_tier(self, nbytes: int) -> int:
        """:meth:`KVFileStore.evict_for_tier`, then :attr:`after_tier_eviction` when anything was freed."""
        freed = super().evict_for_tier(nbytes)
        if freed and self.after_tier_eviction is not None:
            self.after_tier_eviction()
        return freed

    def read_whole(self, name: str, buf: memoryview) -> ChunkHandle | None | bool:
        """Read chunk ``name``'s header page and data with one O_DIRECT ``preadv`` (header -> a
        private page, data -> ``buf``): one device stream per chunk, no separate header read.

        Checks the header as :meth:`KVFileStore.open_chunk` does (format tag, key, checksum count;
        the caller checks the piece checksums of ``buf``).

        Returns:
            The chunk's handle (its descriptors already closed), None when there is no such chunk,
            or False when this path does not apply (no O_DIRECT, an unaligned buffer, a size that
            is not one header page + ``len(buf)``, a longer header): use :meth:`open_chunk`.
        """
        if not self._direct_ok or buffer_address(buf) % ALIGN or len(buf) % ALIGN:
            return False
        path = self.path_for(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except FileNotFoundError:
            with self._tlock:
                self._index.pop(name, None)
            return None
        except OSError as e:
            if e.errno == errno.EINVAL:  # no O_DIRECT on this file system
                return False
            raise
        try:
            st = os.fstat(fd)
            if st.st_size != HEADER_ALIGN + len(buf):
                return False
            page = getattr(_PAGE, "buf", None)
            if page is None:
                page = _PAGE.buf = mmap.mmap(-1, HEADER_ALIGN)
            if os.preadv(fd, [page, buf], 0) != st.st_size:
                return False
        finally:
            os.close(fd)
        try:
            (n,) = struct.unpack("<Q", page[:8])
            if 8 + n > HEADER_ALIGN:
                return False
            hdr = parse_header(bytes(page[8:8 + n]), st.st_size, path=path)
            meta = hdr.metadata or {}
            if hdr.data_offset != HEADER_ALIGN:
                return False
            if meta.get("format") != FORMAT_TAG or chunk_name(meta["key"]) != name:
                raise CorruptCheckpointError(f"{path}: not the chunk of {name} (format {meta.get('format')!r})",
                                             path=path)
            piece, hashes = int(meta["piece_bytes"]), json.loads(meta["xxh3_64"])
            if piece <= 0 or len(hashes) != -(-len(buf) // piece):
                raise CorruptCheckpointError(f"{path}: {len(hashes)} checksums for {len(buf)} bytes", path=path)
            return ChunkHandle(name, path, -1, -1, hdr.data_offset, chunk_groups(hdr.tensors, len(buf), path),
                               len(buf), meta["fmt"], meta["key"], piece, hashes, st.st_ino)
        except Exception as e:  # noqa: BLE001 - any header that does not parse as ours is a bad file: a miss
            self.drop_corrupt(ChunkHandle(name, path, -1, -1, 0, [], 0, "", "", 1, [], st.st_ino), str(e))
            return None

    def take_removed(self) -> list[str]:
        """Names removed since the last call (the adapter reports those it still lists as stored)."""
        with self._tlock:
            out = list(self.removed)
            self.removed.clear()  # the same list: on_remove appends to it
        return out


_PAGE = threading.local()  # one header page per reading thread (page-aligned: an mmap)


def _layout_of(obj, nbytes: int) -> tuple[str, list]:
    """``(memory format name, [(dtype, shape, nbytes)])`` of ``obj``; one ``U8`` group when it has no layout."""
    meta = getattr(obj, "metadata", None)
    try:
        shapes = meta.shapes or [meta.shape]
        dtypes = meta.dtypes or [meta.dtype]
        groups = [(dtype_to_str(dt, tensor="kv"), tuple(int(x) for x in s), math.prod(s) * dt.itemsize)
                  for s, dt in zip(shapes, dtypes, strict=True)]
        if sum(g[2] for g in groups) == nbytes:
            return meta.fmt.name, groups
    except Exception:  # no metadata (a bare buffer) or a layout we do not describe: store the bytes
        pass
    return "BINARY", [("U8", (nbytes,), nbytes)]


def _bytes_of(obj) -> memoryview:
    """``obj.byte_array`` as a flat byte view."""
    buf = obj.byte_array
    buf = buf if isinstance(buf, memoryview) else memoryview(buf)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


class FastCkptL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter storing each object as a chunk file of a shared fastckpt KV folder.

    Args:
        config: a :class:`FastCkptL2AdapterConfig`, or the raw ``adapter_params`` dict.
        l1_memory_desc: LMCache's L1 descriptor (unused: we read and write the caller's buffers).

    Raises:
        ValueError: a malformed option (see :meth:`FastCkptL2AdapterConfig.from_dict`).
        OSError: the folder cannot be created or its lock file opened.
    """

    def __init__(self, config: FastCkptL2AdapterConfig | dict, l1_memory_desc: Any = None):
        if isinstance(config, dict):
            config = FastCkptL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.store.max_bytes)
        self.config = config
        self._verify = config.store.verify
        # the store reads spans unchecked; _read_span checks every piece of the span itself
        self.store = _WholeChunkStore(dataclasses.replace(config.store, verify=False))
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._done_stores: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookups: dict[L2TaskId, Bitmap] = {}
        self._done_loads: dict[L2TaskId, Bitmap] = {}
        self._keys: dict[str, tuple[Any, int]] = {}  # chunk name -> (ObjectKey, bytes) this process knows
        # names a store task committed and has not reported stored yet: removed meanwhile, never reported
        self._unreported: set[str] = set()
        # held while deciding and sending listener notices, so a key's "deleted" never precedes its "stored"
        self._notify_lock = threading.RLock()
        self._locks: dict[Any, int] = {}  # ObjectKey -> lookup locks held
        self._last_store_error = ""
        self._closed = False
        # tasks wait on pieces, pieces never wait: two pools, no deadlock
        # tasks mostly wait (or read their last span): one per possible reader and writer
        self._tasks = ThreadPoolExecutor(config.read_threads + config.write_threads, thread_name_prefix="fckv-l2-task")
        self._io = ThreadPoolExecutor(max(config.read_threads, config.write_threads), thread_name_prefix="fckv-l2-io")
        self.store.after_tier_eviction = self._report_evicted  # a checkpoint took the room: tell LMCache now
        logger.info("fastckpt kv: L2 adapter at %s, max_bytes=%d, read_threads=%d, o_direct=%s",
                    self.store.root, config.store.max_bytes, config.read_threads, config.store.o_direct)

    # ----- event fds ---------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        """Event fd signalled when a store task ends."""
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        """Event fd signalled when a lookup task ends."""
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        """Event fd signalled when a load task ends."""
        return self._load_efd.fileno()

    def _new_id(self) -> L2TaskId:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
        return tid

    @staticmethod
    def _key_string(key) -> str:
        return "lmcache-mp:" + _object_key_to_string(key)

    def _name(self, key) -> str:
        return chunk_name(self._key_string(key))

    # ----- store -------------------------------------------------------------------------
    def submit_store_task(self, keys: list, objects: list) -> L2TaskId:
        """Write each object as a chunk file; the task succeeds if every write committed or existed.

        Args:
            keys: LMCache ``ObjectKey``s. objects: their ``MemoryObj``s (``byte_array`` is read
                until the task's event fires; the caller keeps them alive until then).

        Returns:
            The task id; :meth:`pop_completed_store_tasks` gives its ``L2StoreResult``.
        """
        tid = self._new_id()
        self._tasks.submit(self._run_store, tid, list(keys), list(objects))
        return tid

    def _write_one(self, key, obj) -> int:
        """Bytes committed for ``key`` (0 if the chunk already existed). The chunk is known (unreported)
        before its commit, so an eviction right after the commit is seen by :meth:`_report_evicted`
        (known only after it, such an eviction went unreported and the key stayed "stored")."""
        buf = _bytes_of(obj)
        fmt, groups = _layout_of(obj, len(buf))
        name = self._name(key)
        with self._lock:
            known = name in self._keys  # reported stored before, or another task of this key is writing
            if not known:
                self._keys[name] = (key, len(buf))
                self._unreported.add(name)
        wrote = False
        try:
            wrote = self.store.write(name, self._key_string(key), fmt, groups, buf)
        finally:
            with self._lock:
                # failed, or existed: forget it. (Written after another task's write of the key failed,
                # it stays unknown: never reported stored nor deleted; lookups still find it on disk.)
                if not wrote and not known and name in self._unreported:
                    self._keys.pop(name, None)
                    self._unreported.discard(name)
        if not wrote:
            self.store.touch(name)
            return 0
        return len(buf)

    def _run_store(self, tid: L2TaskId, keys: list, objects: list) -> None:
        ok, written, stored, sizes = True, 0, [], []
        try:
            futs = [self._io.submit(self._write_one, k, o) for k, o in zip(keys, objects, strict=True)]
            wait(futs)
            for key, fut in zip(keys, futs):
                err = fut.exception()
                if err is not None:
                    ok = False
                    self._last_store_error = f"{type(err).__name__}: {err}"
                    logger.warning("fastckpt kv: L2 store of %s failed (%s); the key stays a miss",
                                   self._key_string(key), self._last_store_error)
                    continue
                n = fut.result()
                if n:
                    stored.append((key, self._name(key), n))
                    written += n
        except Exception as e:  # the task must end with a result, whatever happened
            ok = False
            self._last_store_error = f"{type(e).__name__}: {e}"
            logger.exception("fastckpt kv: L2 store task %d failed", tid)
        with self._notify_lock:
            self._report_evicted()  # first: a chunk of this task evicted already is never reported stored
            with self._lock:
                now = [(k, n) for k, name, n in stored if name in self._unreported]
                self._unreported.difference_update(name for _, name, _ in stored)
            if now:
                self._notify_keys_stored([k for k, _ in now], [n for _, n in now])
        with self._lock:
            self._done_stores[tid] = L2StoreResult(ok, written)
        self._store_efd.notify()

    def _report_evicted(self) -> None:
        """Tell the listeners which known chunks this process removed since the last call (evictions for
        a put or the tier, chunks dropped as corrupt); a chunk whose store task has not reported it
        stored yet is only forgotten (its task will not report it either)."""
        with self._notify_lock:
            gone = []
            with self._lock:
                for name in self.store.take_removed():
                    ks = self._keys.pop(name, None)
                    if ks is None:
                        continue
                    if name in self._unreported:
                        self._unreported.discard(name)
                    else:
                        gone.append(ks)
            if gone:
                self._notify_keys_deleted([k for k, _ in gone], [n for _, n in gone])

    def _report_gone(self, name: str) -> None:
        """Chunk ``name`` was found missing (another process removed it: the folder's ``max_bytes`` and
        the tier's budget are shared): tell the listeners if they were told it was stored."""
        with self._notify_lock:
            with self._lock:
                if name in self._unreported:
                    return  # its store task is still running: it reports what it finds then
                ks = self._keys.pop(name, None)
            if ks is not None:
                self._notify_keys_deleted([ks[0]], [ks[1]])

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        """All store results ready since the last call (task id -> ``L2StoreResult``)."""
        with self._lock:
            out, self._done_stores = self._done_stores, {}
        return out

    # ----- lookup and lock ---------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> L2TaskId:
        """Find which ``keys`` are committed (by any process) and pin those against our eviction.

        Returns:
            The task id; :meth:`query_lookup_and_lock_result` gives one bit per key.
        """
        tid = self._new_id()
        self._tasks.submit(self._run_lookup, tid, list(keys))
        return tid

    def _run_lookup(self, tid: L2TaskId, keys: list) -> None:
        bm = Bitmap(len(keys))
        try:
            for i, key in enumerate(keys):
                name = self._name(key)
                if self.store.contains(name):
                    self.store.pin(name)
                    with self._lock:
                        self._locks[key] = self._locks.get(key, 0) + 1
                    bm.set(i)
                elif name in self._keys:  # stored by us, removed by another process meanwhile
                    self._report_gone(name)
        except Exception:
            logger.exception("fastckpt kv: L2 lookup task %d failed; the rest are misses", tid)
        found = sum(bm.test(i) for i in range(len(keys)))
        self.store.stats.add(lookup_hits=found, lookup_misses=len(keys) - found)
        with self._lock:
            self._done_lookups[tid] = bm
        self._lookup_efd.notify()
        self._report_evicted()  # chunks evicted for the tier's budget since the last task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        """The lookup bitmap of ``task_id`` once (None before it is ready and after it was taken)."""
        with self._lock:
            return self._done_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
        """Release one lookup lock of each key (keys not locked are ignored)."""
        for key in keys:
            with self._lock:
                n = self._locks.get(key, 0)
                if n == 0:
                    continue
                if n == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = n - 1
            self.store.unpin(self._name(key))

    # ----- load --------------------------------------------------------------------------
    def submit_load_task(self, keys: list, objects: list) -> L2TaskId:
        """Read each key's chunk into its object's ``byte_array`` (checksummed; a bad chunk is a miss).

        Returns:
            The task id; :meth:`query_load_result` gives one bit per key (1 = loaded).
        """
        tid = self._new_id()
        self._tasks.submit(self._run_load, tid, list(keys), list(objects))
        return tid

    def _run_load(self, tid: L2TaskId, keys: list, objects: list) -> None:
        try:
            self._load(tid, keys, objects)
        finally:
            self._report_evicted()  # chunks dropped as corrupt by this load, evicted for the tier meanwhile

    def _load(self, tid: L2TaskId, keys: list, objects: list) -> None:
        t0 = time.perf_counter()
        n = len(keys)
        bm = Bitmap(n)
        loaded, handles = [], []
        try:
            names = [self._name(k) for k in keys]
            bufs = [_bytes_of(o) for o in objects]
            if n == 1:  # one request, one chunk: header and data in one read when it applies
                h = self.store.read_whole(names[0], bufs[0])
                if h is not False:
                    self._finish_whole(tid, keys[0], h, bufs[0], t0)
                    return
            handles = list(self._io.map(self.store.open_chunk, names)) if n > 1 else \
                [self.store.open_chunk(names[0])] if n else []
            jobs = {}
            for i, h in enumerate(handles):
                if h is None:
                    continue
                buf = bufs[i]
                if len(buf) != h.nbytes:
                    logger.warning("fastckpt kv: L2 load of %s: the chunk holds %d bytes, the buffer %d; a miss",
                                   h.key, h.nbytes, len(buf))
                    continue
                step = h.piece_bytes * SPAN_PIECES
                jobs[i] = [(h, buf, s, min(step, h.nbytes - s)) for s in range(0, h.nbytes, step)]
            spans = [(i, j) for i, js in jobs.items() for j in js]
            futs = {}
            for i, j in spans[:-1]:  # to the I/O threads; the last span is read here (no hand-off)
                futs.setdefault(i, []).append(self._io.submit(self._read_span, *j))
            errs: dict = {}
            if spans:
                i, j = spans[-1]
                try:
                    self._read_span(*j)
                except Exception as e:
                    errs[i] = e
            for i in jobs:
                wait(futs.get(i, []))
                err = errs.get(i) or next((f.exception() for f in futs.get(i, []) if f.exception() is not None),
                                          None)
                if err is not None:
                    self.store.read_failed(handles[i], err)  # a bad file is dropped; EIO and the like keep it
                    continue
                self.store.touch(names[i])
                bm.set(i)
                loaded.append(keys[i])
            self.store.stats.add(hits=len(loaded), misses=n - len(loaded),
                                 get_bytes=sum(handles[i].nbytes for i in range(n) if bm.test(i)),
                                 get_s=time.perf_counter() - t0)
        except Exception:
            logger.exception("fastckpt kv: L2 load task %d failed; its unread keys are misses", tid)
        finally:
            for h in handles:
                if h is not None:
                    self.store.close_chunk(h)
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._done_loads[tid] = bm
        self._load_efd.notify()

    def _finish_whole(self, tid: L2TaskId, key, h, buf: memoryview, t0: float) -> None:
        """End a one-chunk load task read by :meth:`_WholeChunkStore.read_whole` (``h`` None: a miss)."""
        bm = Bitmap(1)
        try:
            if h is not None:
                self._check(h, buf, 0, h.nbytes)
                self.store.touch(h.name)
                bm.set(0)
        except CorruptCheckpointError as e:
            self.store.drop_corrupt(h, str(e))
        self.store.stats.add(hits=int(bm.test(0)), misses=1 - int(bm.test(0)),
                             get_bytes=h.nbytes if bm.test(0) else 0, get_s=time.perf_counter() - t0)
        if bm.test(0):
            self._notify_keys_accessed([key])
        with self._lock:
            self._done_loads[tid] = bm
        self._load_efd.notify()

    def _check(self, h, buf: memoryview, start: int, length: int) -> None:
        """Check the xxh3-64 of each piece in data bytes ``[start, start+length)`` (when ``verify``).

        Raises:
            CorruptCheckpointError: a piece's checksum does not match.
        """
        if not self._verify:
            return
        for s in range(start, start + length, h.piece_bytes):
            i = s // h.piece_bytes
            if xxhash.xxh3_64_hexdigest(buf[s:min(s + h.piece_bytes, start + length)]) != h.piece_hashes[i]:
                raise CorruptCheckpointError(f"{h.path}: checksum mismatch in piece {i} (data bytes "
                                             f"[{s}, {min(s + h.piece_bytes, start + length)}))", path=h.path)

    def _read_span(self, h, buf: memoryview, start: int, length: int) -> None:
        """Read data bytes ``[start, start+length)`` (whole pieces) of ``h`` in one call, then check
        each piece's xxh3-64 (when ``verify``).

        Raises:
            CorruptCheckpointError: the file ends early or a piece's checksum does not match.
        """
        self.store.read_piece(h, buf, start, length)
        self._check(h, buf, start, length)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        """The load bitmap of ``task_id`` once (None before it is ready and after it was taken)."""
        with self._lock:
            return self._done_loads.pop(task_id, None)

    # ----- eviction, listing, status -----------------------------------------------------
    def delete(self, keys: list) -> None:
        """Delete the chunks of ``keys`` (missing ones are skipped) and tell the listeners."""
        if not keys or self._closed:
            return
        with self._notify_lock:
            gone, sizes = [], []
            for key in keys:
                name = self._name(key)
                with self._lock:  # taken first: the removal is reported here, never again by _report_evicted
                    ks = self._keys.pop(name, None)
                    told = ks is not None and name not in self._unreported  # the listeners were told "stored"
                    self._unreported.discard(name)
                try:
                    removed = self.store.remove(name)
                except OSError as e:
                    if ks is not None:
                        with self._lock:
                            self._keys.setdefault(name, ks)
                            if not told:
                                self._unreported.add(name)
                    logger.warning("fastckpt kv: L2 delete of %s failed: %s", self._key_string(key), e)
                    continue
                if told or (removed and ks is None):  # gone now, whoever removed it (another server may have)
                    gone.append(key)
                    sizes.append(ks[1] if ks else 0)
            if gone:
                self._notify_keys_deleted(gone, sizes)

    def debug_has_key(self, key) -> bool:
        """True if ``key``'s chunk is committed (LMCache's tests poll adapters with this)."""
        return self.store.contains(self._name(key))

    def report_status(self) -> dict:
        """Health and the store's counters: ``is_healthy``, ``type``, ``path``, ``used_bytes`` (whole
        folder, all processes), ``max_bytes``, ``last_store_error`` and :class:`KVStats` fields."""
        st = self.store.stats.snapshot()
        return {"is_healthy": not self._closed, "type": CLASS_NAME, "path": self.store.root,
                "used_bytes": self.store.disk_bytes() if self._closed else self.store.used_bytes(),
                "max_bytes": self.config.store.max_bytes, "last_store_error": self._last_store_error, **st}

    def close(self) -> None:
        """Finish running tasks, close the event fds and the store; the adapter is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._tasks.shutdown(wait=True)
        self._io.shutdown(wait=True)
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        logger.info("fastckpt kv: L2 adapter stats at close: %s", self.store.stats.snapshot())
        self.store.close()
