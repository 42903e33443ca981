"""LMCache 0.5.x storage plugin keeping KV-cache chunks as files on a shared tier.

Configure it as an LMCache storage plugin (see ``docs/KV.md``)::

    storage_plugins: ["fastckpt"]
    extra_config:
      storage_plugin.fastckpt.module_path: fastckpt.integrations.lmcache.backend
      storage_plugin.fastckpt.class_name: FastCkptKVBackend
      storage_plugin.fastckpt.path: /mnt/array/kv
      storage_plugin.fastckpt.max_bytes: 107374182400   # whole folder, all servers
      storage_plugin.fastckpt.read_threads: 16
      storage_plugin.fastckpt.o_direct: true

Call order (LMCache 0.5.6, one engine per worker process):
    * ``storage_plugin_launcher`` builds the backend with ``config``, ``metadata``,
      ``local_cpu_backend`` and ``loop``; it logs (does not raise) a failing constructor.
    * Store: ``StorageManager.batched_put`` calls :meth:`batched_submit_put_task` with
      objects from the LocalCPUBackend allocator, then drops its own reference; we
      take one reference per object until its file is committed (or failed).
    * Retrieve: ``batched_contains``/``contains`` (prefix match), then
      ``batched_get_blocking`` (or ``get_blocking``); every returned object comes
      from ``local_cpu_backend.allocate`` with one reference owned by the caller.
      With ``enable_async_loading``: ``batched_async_contains(pin=True)`` then
      ``batched_get_non_blocking``, which releases those pins.

Reads: all chunks of a request are opened and validated in parallel, then every
``piece_bytes`` piece of every chunk is read (and checksummed) by a pool of
``read_threads`` threads, so one request keeps many reads in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, List, Optional, Sequence

import torch
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from fastckpt.format import dtype_to_str, str_to_dtype

from .config import CLASS_NAME, MODULE_PATH, BackendOptions, check_config, parse_options
from fastckpt.kv import ChunkHandle, KVFileStore, chunk_name

logger = logging.getLogger(__name__)

__all__ = ["FastCkptKVBackend", "CLASS_NAME", "MODULE_PATH", "check_config"]


def _groups_of(obj: MemoryObj, nbytes: int) -> list[tuple[str, tuple, int]]:
    meta = obj.metadata
    shapes = meta.shapes or [meta.shape]
    dtypes = meta.dtypes or [meta.dtype]
    out = [(dtype_to_str(d, tensor="kv"), tuple(int(x) for x in s), math.prod(s) * d.itemsize)
           for s, d in zip(shapes, dtypes, strict=True)]
    if sum(g[2] for g in out) != nbytes:
        raise ValueError(f"memory object groups {out} do not add up to its {nbytes} bytes")
    return out


class FastCkptKVBackend(StoragePluginInterface):
    """LMCache storage plugin: one safetensors file per KV chunk under a shared folder.

    Args:
        dst_device: device LMCache asks for (unused: objects come from the CPU allocator).
        config: the ``LMCacheEngineConfig``; our options are read from ``extra_config``
            keys ``storage_plugin.<name>.*`` (see :mod:`.config`).
        metadata: the ``LMCacheMetadata`` (unused).
        local_cpu_backend: LMCache's CPU backend; its allocator provides every buffer
            returned by a get. Required.
        loop: LMCache's event loop (unused; the non-blocking paths use our threads).

    Raises:
        ValueError: missing ``path`` or a malformed option, or no ``local_cpu_backend``
            (set ``max_local_cpu_size`` > 0).
        OSError: the folder cannot be created.
    """

    def __init__(self, dst_device: str = torch_device_type, config=None, metadata=None,
                 local_cpu_backend=None, loop: Optional[asyncio.AbstractEventLoop] = None):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        for w in check_config(config or {}):
            logger.warning("fastckpt kv: %s", w)
        if local_cpu_backend is None:
            raise ValueError(f"{CLASS_NAME} needs LMCache's LocalCPUBackend as its allocator: "
                             "set max_local_cpu_size > 0")
        self.name, self.options = parse_options(config or {})
        self.store = KVFileStore(self.options.store)
        o: BackendOptions = self.options
        self._read_pool = ThreadPoolExecutor(o.read_threads, thread_name_prefix="fckv-read")
        self._write_pool = ThreadPoolExecutor(o.write_threads, thread_name_prefix="fckv-write")
        self._req_pool = ThreadPoolExecutor(max(2, o.read_threads // 4), thread_name_prefix="fckv-req")
        self._pending: set[str] = set()
        self._plock = threading.Lock()
        self._last_log = time.monotonic()
        self._closed = False
        self._futures: set[Future] = set()
        self._drain_before_allocator_close(local_cpu_backend)
        logger.info("fastckpt kv: plugin %r at %s, max_bytes=%d, read_threads=%d, o_direct=%s",
                    self.name, self.store.root, o.store.max_bytes, o.read_threads, o.store.o_direct)

    def __str__(self) -> str:
        return self.name

    def _drain_before_allocator_close(self, cpu_backend) -> None:
        # StorageManager.close() (0.5.6) closes LocalCPUBackend, which frees the buffers our
        # queued writes still read, before it closes plugins: finish our writes first.
        orig = cpu_backend.close

        def close_after_drain():
            self.flush()
            orig()

        cpu_backend.close = close_after_drain

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait for every queued write to end (committed or failed).

        Args:
            timeout_s: most seconds to wait; None waits for all. Default None.

        Returns:
            True if no write is left in flight.
        """
        with self._plock:
            futs = list(self._futures)
        done, not_done = wait(futs, timeout=timeout_s)
        return not not_done

    @staticmethod
    def _name(key: CacheEngineKey) -> str:
        return chunk_name(key.to_string())

    # ----- lookup ------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """True if ``key``'s chunk is committed in the folder; ``pin`` protects it from our eviction."""
        name = self._name(key)
        if not self.store.contains(name):
            return False
        if pin:
            self.store.pin(name)
        return True

    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading ``keys`` present (prefix match); pins them when ``pin``."""
        hit = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hit += 1
        self.store.stats.add(lookup_hits=hit, lookup_misses=int(hit < len(keys)))
        return hit

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Number of leading ``keys`` present (prefix match); pins them when ``pin``."""
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """True while ``key``'s put is queued or being written by this process."""
        name = self._name(key)
        with self._plock:
            if name in self._pending:
                return True
        return self.store.is_writing(name)

    def pin(self, key: CacheEngineKey) -> bool:
        """Protect ``key`` from this process's evictions; False if it is not stored."""
        return self.contains(key, pin=True)

    def unpin(self, key: CacheEngineKey) -> bool:
        """Undo one :meth:`pin`; False if it was not pinned."""
        return self.store.unpin(self._name(key))

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete ``key``'s chunk file; True if one was deleted."""
        return self.store.remove(self._name(key))

    def touch_cache(self) -> None:
        """No-op: recency is updated on every hit."""

    def get_allocator_backend(self):
        """LMCache's LocalCPUBackend, whose allocator provides our get buffers."""
        return self.local_cpu_backend

    # ----- put ---------------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: List[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
                                ) -> Optional[List[Future]]:
        """Write each chunk in the background; return one Future per submitted write.

        Keys already stored (by any process) or already queued here are skipped.
        Each submitted object gets ``ref_count_up`` now and ``ref_count_down`` when
        its write ends; the Future's result is True if the file was committed.
        """
        futures = []
        for key, obj in zip(keys, objs, strict=True):
            name = self._name(key)
            with self._plock:
                if name in self._pending:
                    continue
                if self.store.contains(name):
                    self.store.touch(name)
                    continue
                self._pending.add(name)
            obj.ref_count_up()
            fut = self._write_pool.submit(self._put_one, key, name, obj, on_complete_callback)
            with self._plock:
                self._futures.add(fut)
            fut.add_done_callback(self._forget)
            futures.append(fut)
        return futures or None

    def _forget(self, fut: Future) -> None:
        with self._plock:
            self._futures.discard(fut)

    def _put_one(self, key, name, obj, callback) -> bool:
        ok = False
        try:
            buf = obj.byte_array
            groups = _groups_of(obj, len(buf))
            ok = self.store.write(name, key.to_string(), obj.metadata.fmt.name, groups, buf)
        except Exception as e:  # a failed put is a miss later, never an error for the model
            logger.warning("fastckpt kv: put of %s failed (%s: %s); the key stays a miss",
                           key.to_string(), type(e).__name__, e, exc_info=True)
        finally:
            obj.ref_count_down()
            with self._plock:
                self._pending.discard(name)
        if ok and callback is not None:
            try:
                callback(key)
            except Exception as e:
                logger.warning("fastckpt kv: on_complete_callback failed for %s: %s", key, e)
        self._maybe_log()
        return ok

    # ----- get ---------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """Read one chunk into a new LocalCPUBackend buffer; None on a miss."""
        return self._get_many([key])[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Read the leading present chunks of ``keys`` in parallel; None from the first miss on."""
        return self._get_many(list(keys))

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        """Future of :meth:`get_blocking`, or None if ``key`` is not stored."""
        if not self.contains(key):
            return None
        return self._req_pool.submit(lambda: self._get_many([key])[0])

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """Read the leading present chunks without blocking the event loop; releases lookup pins."""
        loop = asyncio.get_running_loop()
        try:
            objs = await loop.run_in_executor(self._req_pool, lambda: self._get_many(list(keys), busy_loop=False))
        finally:
            for k in keys:
                self.store.unpin(self._name(k))
        out = []
        for obj in objs:
            if obj is None:
                break
            out.append(obj)
        return out

    def _get_many(self, keys: list, busy_loop: bool = True) -> list:
        t0 = time.perf_counter()
        n = len(keys)
        if n == 0:
            return []
        names = [self._name(k) for k in keys]
        handles = list(self._read_pool.map(self.store.open_chunk, names)) if n > 1 else [self.store.open_chunk(names[0])]
        objs: list = [None] * n
        for i, h in enumerate(handles):
            if h is None:
                break
            objs[i] = self._allocate(h, busy_loop)
            if objs[i] is None:
                break
        jobs = {i: [self._read_pool.submit(self.store.read_piece, handles[i], objs[i].byte_array, s, ln)
                    for s, ln in handles[i].pieces()] for i in range(n) if objs[i] is not None}
        nbytes = 0
        for i, futs in jobs.items():
            wait(futs)
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            if err is not None:
                self.store.read_failed(handles[i], err)  # a bad file is dropped; EIO and the like keep it
                objs[i].ref_count_down()
                objs[i] = None
            else:
                nbytes += handles[i].nbytes
                self.store.touch(names[i])
        for h in handles:
            if h is not None:
                self.store.close_chunk(h)
        first_miss = next((i for i, o in enumerate(objs) if o is None), n)
        for i in range(first_miss + 1, n):  # prefix semantics: nothing after a miss is usable
            if objs[i] is not None:
                objs[i].ref_count_down()
                objs[i] = None
        self.store.stats.add(hits=first_miss, misses=n - first_miss, get_bytes=nbytes,
                             get_s=time.perf_counter() - t0)
        self._maybe_log()
        return objs

    def _allocate(self, h: ChunkHandle, busy_loop: bool) -> Optional[MemoryObj]:
        try:
            dtypes = [str_to_dtype(d, path=h.path) for d, _ in h.groups]
            shapes = [torch.Size(s) for _, s in h.groups]
            fmt = MemoryFormat[h.fmt]
        except Exception as e:
            self.store.drop_corrupt(h, f"unusable header: {e}")
            return None
        one = len(shapes) == 1
        obj = self.local_cpu_backend.allocate(shapes[0] if one else shapes, dtypes[0] if one else dtypes,
                                              fmt, busy_loop=busy_loop)
        if obj is None:
            logger.warning("fastckpt kv: LocalCPUBackend could not allocate %d bytes for %s; "
                           "returning a shorter prefix", h.nbytes, h.key)
            return None
        if len(obj.byte_array) != h.nbytes:
            obj.ref_count_down()
            self.store.drop_corrupt(h, f"{h.nbytes} data bytes but the allocated object holds "
                                       f"{len(obj.byte_array)}")
            return None
        return obj

    # ----- stats and shutdown ---------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of this process: hits, misses, get/put bytes and seconds, GB/s, evictions..."""
        d = self.store.stats.snapshot()
        d["used_bytes"] = self.store.disk_bytes() if self._closed else self.store.used_bytes()
        d["max_bytes"] = self.options.store.max_bytes
        return d

    def _maybe_log(self) -> None:
        iv = self.options.stats_log_interval_s
        now = time.monotonic()
        if iv > 0 and now - self._last_log >= iv:
            self._last_log = now
            logger.info("fastckpt kv stats: %s", self.store.stats.snapshot())

    def close(self) -> None:
        """Finish queued writes, stop the threads, log the counters."""
        if self._closed:
            return
        self._closed = True
        self._write_pool.shutdown(wait=True)
        self._req_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        logger.info("fastckpt kv stats at close: %s", self.store.stats.snapshot())
        self.store.close()
