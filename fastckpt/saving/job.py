"""One rank's part of one save: its files, its staging copy, its writes, the link decisions.

:class:`SaveJob` is what :class:`fastckpt.saving.saver.Saver` runs on every rank of a save (a
save of one process is the one-rank case: the job owns every write unit). The caller's thread
runs ``link_unchanged`` (``link_from``, folder leader only), ``open_files`` and ``stage``; the
background thread runs ``start_verify``, ``write_all`` (which first stages deferred tensors),
``verify_links``, ``record_hashes`` and ``close``. Small helpers for batched staging copies
and batched hashing live here too.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash

from ..device import DONE, AllOf, Completion, cat_to_host, to_host
from ..format.layout import SavePlan
from ..storage.io import ALIGN, FileWriter, default_threads, get_backend, write_all
from ..storage.staging import StagingPool, copy_pieces, copy_runs
from ..storage.store import LOCAL
from ..storage.tier import NO_WRITES, tier_for
from . import dedupe
from .dedupe import LinkUnchanged
from .deferred import DeferredStaging
from .direct import DirectWrites

if TYPE_CHECKING:
    from .options import SaveOptions




@dataclass(frozen=True)
class Part:
    """The part of a plan one rank writes (a one-process save: everything).

    Attributes:
        units: indexes of the plan's write units this rank writes (stream order; ``None``: all).
        files: indexes of the files present in this rank's folder (``None``: all).
        leader: this rank creates the files, writes every header and links unchanged files.
    """

    units: tuple[int, ...] | None = None
    files: tuple[int, ...] | None = None
    leader: bool = True


class SaveJob(LinkUnchanged, DeferredStaging, DirectWrites):
    """One rank's part of one save: files, staging buffer, writer pool.

    Args:
        plan: the save's plan (the same on every rank).
        tmp: the folder the files are written into (the hidden temporary folder).
        opts: the save's options.
        pool: staging memory of the saver.
        cache: the saver's hash cache (``link_check="version"``).
        part: what this rank writes (default: everything).
    """

    def __init__(self, plan: SavePlan, tmp: str, opts: SaveOptions, pool: StagingPool,
                 cache: dedupe.HashCache | None = None, part: Part = Part()):
        self.plan, self.tmp, self.opts, self.pool = plan, tmp, opts, pool
        self.io, self.cons = opts.io, opts.consistency
        self.part = part
        self.all_units = part.units is None
        self.owned: list[int] = list(range(len(plan.units))) if part.units is None else list(part.units)
        self.files = range(len(plan.files)) if part.files is None else part.files
        # link_check="version": hashes of earlier saves, and what this save adds to them
        self.cache = cache if self.cons.link_check == "version" else None
        self.idents: dict[str, Any] = {}  # key -> HashCache.ident at the call (staged/hashed tensors)
        self.to_verify: list[tuple[str, Any, str, int]] = []  # (key, tensor, xxh3, version at call)
        self.verifying: dict = {}  # to_verify item -> _Pick of "changed?" (see start_verify)
        self.be = get_backend(self.io.io_backend)
        self.writers: list[FileWriter | None] = [None] * len(plan.files)
        self.exec = ThreadPoolExecutor(self.io.threads or default_threads(), thread_name_prefix="fastckpt-io")
        self.unit_futs: dict[int, Future] = {}
        self.hashes: dict[str, Any] = {}
        self.buf = self.view = None
        self.streaming = False
        self.first_exc: BaseException | None = None  # the first failed write (raised by the save)
        self.exc_lock = threading.Lock()
        self.linked: set[int] = set()  # file indexes hard-linked from opts.link_from
        # defer / defer_frozen: key -> (recorded xxh3 or None, version at the call) of tensors
        # that write_all stages; ``staged`` is set once no source is needed any more
        self.deferred: dict[str, tuple[str | None, int]] = {}
        self.staged = threading.Event()
        self.sources: dict[str, torch.Tensor] = {}
        self.segs: list[tuple[int, int, int]] = []  # (stream start, stream end, buffer offset) when not all units
        self.seg_starts: list[int] = []
        self.bytes_written = 0  # bytes this rank wrote itself (units + headers)
        self.held = False  # holds the staging pool's buffer
        self.direct = False  # written from the sources, not staged (write_direct: fastckpt.save)
        self.tier = NO_WRITES  # this save's capacity claim and write pacing on the tier (open_files)

    def _at(self, stream_off: int) -> int:
        """Buffer offset of stream offset ``stream_off`` (whole-state staging)."""
        if self.all_units:
            return stream_off
        i = bisect.bisect_right(self.seg_starts, stream_off) - 1
        a, _, b = self.segs[i]
        return b + stream_off - a

    def _mine(self) -> list:
        """Tensors this rank stages (stream order): those overlapping a unit it writes, in files not linked."""
        p = self.plan
        if self.all_units:
            return sorted((t for i, f in enumerate(p.files) if i not in self.linked for t in f.tensors),
                          key=lambda t: t.stream_offset)
        spans = [(p.units[i].stream_offset, p.units[i].stream_offset + p.units[i].nbytes) for i in self.owned
                 if p.units[i].file_index not in self.linked]
        starts = [a for a, _ in spans]
        out = []
        for fi, f in enumerate(p.files):
            if fi in self.linked:
                continue
            for t in f.tensors:
                a, b = t.stream_offset, t.stream_offset + t.spec.nbytes
                j = bisect.bisect_right(starts, b - 1) - 1
                if b > a and j >= 0 and spans[j][1] > a:
                    out.append(t)
        return sorted(out, key=lambda t: t.stream_offset)

    def hashed_keys(self, tensors: list) -> list:
        """The tensors whose xxh3 this rank reports: those whose first byte it writes."""
        if self.all_units:
            return tensors
        owned = {i for i in self.owned}
        firsts = [u.stream_offset for u in self.plan.units]
        out = []
        for t in tensors:
            i = bisect.bisect_right(firsts, t.stream_offset) - 1
            if i in owned:
                out.append(t)
        return out

    def _layout(self, tensors: list) -> int:
        """Buffer segments covering the units this rank writes and the tensors it stages; returns bytes."""
        if self.all_units:
            return self.plan.stream_bytes
        p, gap = self.plan, self.plan.chunk_bytes
        spans = sorted([(p.units[i].stream_offset, p.units[i].stream_offset + p.units[i].nbytes) for i in self.owned
                        if p.units[i].file_index not in self.linked]
                       + [(t.stream_offset, t.stream_offset + t.spec.nbytes) for t in tensors])
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1] + gap:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.segs, off = [], 0
        for a, b in merged:  # page-aligned in the buffer as in the stream: O_DIRECT writes stay aligned
            a -= a % ALIGN
            b += -b % ALIGN
            self.segs.append((a, b, off))
            off += b - a
        self.seg_starts = [a for a, _, _ in self.segs]
        return off
    def batched(self, items: list, size: Callable[[Any], int], fn: Callable[[Any], Any], *,
                wait: bool = True) -> dict:
        """``{item: fn(item)}``, computed on the I/O pool in batches of >= :data:`_BATCH_BYTES`
        (one task per tensor costs more than hashing a small one). With ``wait=False`` the
        values are futures of the batches' results. A single batch runs in the caller's thread."""
        batches, cur, cur_bytes = [], [], 0
        for it in items:
            cur.append(it)
            cur_bytes += size(it)
            if cur_bytes >= _BATCH_BYTES:
                batches.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            batches.append(cur)
        run = lambda b: [fn(it) for it in b]  # noqa: E731  (xxhash releases the GIL on big buffers)
        if wait and len(batches) <= 1:
            return {it: v for b in batches for it, v in zip(b, run(b))}
        futs = [(b, self.exec.submit(run, b)) for b in batches]
        if not wait:
            return {it: _Pick(f, i) for b, f in futs for i, it in enumerate(b)}
        return {it: v for b, f in futs for it, v in zip(b, f.result())}

    def open_files(self) -> None:
        """Leader: create (and preallocate) every file of the folder not linked; other ranks:
        open the existing files holding a unit they write."""
        p = self.plan
        if self.part.leader:
            todo = [i for i in self.files if i not in self.linked]
        else:
            todo = sorted({p.units[i].file_index for i in self.owned} - self.linked)
        self.tier = tier_for(self.tmp).checkpoint(self.tmp, sum(p.files[i].size for i in todo) if self.part.leader else 0)
        for i in todo:
            self.writers[i] = LOCAL.open_write(LOCAL.join(self.tmp, p.files[i].name), p.files[i].size,
                                               o_direct=self.io.o_direct is not False, create=self.part.leader, backend=self.be)

    def _write_unit(self, i: int, slot_off: int) -> None:
        if self.first_exc is not None:
            raise self.first_exc  # a write already failed: do not keep writing
        u = self.plan.units[i]
        try:
            with self.tier.write(u.nbytes):  # the tier: readers first (bounded)
                self.writers[u.file_index].write(self.view[slot_off:slot_off + u.nbytes], u.file_offset)
            self.bytes_written += u.nbytes
        except BaseException as e:
            with self.exc_lock:
                if self.first_exc is None:
                    self.first_exc = e
            raise

    def stage(self, sources: dict, frozen: set[str] = frozenset(), trainable: set[str] = frozenset()) -> None:
        """Copy every tensor into the staging buffer (the caller's blocking part)."""
        chunk = self.plan.chunk_bytes
        budget = self.io.staging_bytes
        tensors = self._mine()
        need = self._layout(tensors)
        self.streaming = budget is not None and budget < need
        size = max(2, budget // chunk) * chunk if self.streaming else need
        devices = {v.device.type for v in sources.values() if getattr(v, "device", None) is not None}
        self.buf, self.view = self.pool.acquire(size, "cuda" in devices)  # page-locked for CUDA sources only
        self.held = True
        if self.cache is not None:  # frozen parameters: their hashes let the next save link them
            self.idents.update((t.spec.key, dedupe.HashCache.ident(sources[t.spec.key]))
                               for t in tensors if t.spec.key in frozen)
        host = devices <= {"cpu"}
        if host and not self.streaming and (self.cons.defer is not None
                                            or (self.cache is not None and self.cons.defer_frozen)):
            self._defer(tensors, sources, frozen, trainable)
            tensors = [t for t in tensors if t.spec.key not in self.deferred]
        if not self.streaming:
            # host sources: each write unit goes out as soon as its bytes are staged, so the
            # disk works while the caller copies (save total ~ max(copy, write), not the sum)
            early = self.cons.early_writes and host and not self.deferred
            units, owned, nxt = self.plan.units, self.owned, 0
            copies: list[Completion] = []
            for run in copy_runs(tensors, sources):
                b, done = self._copy_run(run, sources)
                copies.append(done)
                if early:
                    done.wait()  # (host: complete at once) its units are written only once their bytes are there
                    while nxt < len(owned) and units[owned[nxt]].stream_offset + units[owned[nxt]].nbytes <= b:
                        i = owned[nxt]
                        if units[i].file_index not in self.linked:
                            self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(units[i].stream_offset))
                        nxt += 1
            AllOf(copies).wait()  # every staged byte is there before write_all hashes or writes it
            return
        self._stage_streaming(tensors, sources, size // chunk)

    def _copy_run(self, run: list, sources: dict) -> tuple[int, Completion]:
        """Start staging one run of :func:`~fastckpt.storage.staging.copy_runs` through the device-copy
        layer; returns the stream offset just past it and the copy's completion (wait for it before
        hashing or writing any byte of the run: a CUDA/NPU event, :data:`~fastckpt.device.DONE` on CPU)."""
        a, b = run[0].stream_offset, run[-1].stream_offset + run[-1].spec.nbytes
        x = self._at(a)
        if b == a:
            return b, DONE
        if len(run) == 1:
            return b, to_host(self.buf[x:x + b - a], sources[run[0].spec.key])
        # one op for many small tensors: per-tensor views and copies cost ~10 us each
        return b, cat_to_host(self.buf[x:x + b - a], [sources[t.spec.key] for t in run])

    def _stage_streaming(self, tensors: list, sources: dict, n_slots: int) -> None:
        chunk = self.plan.chunk_bytes
        owned = [i for i in self.owned if self.plan.units[i].file_index not in self.linked]
        grid = {self.plan.units[i].stream_offset // chunk: i for i in owned}
        next_unit = 0

        def slot_of(g: int):
            submit_ready(g * chunk)  # everything before grid line g is staged
            old = grid.get(g - n_slots)
            if old is not None and old in self.unit_futs:
                self.unit_futs[old].result()
            s = (g % n_slots) * chunk
            return self.buf[s:s + chunk]

        def submit_ready(cursor: int) -> int:
            nonlocal next_unit
            while next_unit < len(owned):
                i = owned[next_unit]
                u = self.plan.units[i]
                if u.stream_offset + u.nbytes > cursor:
                    break
                slot = ((u.stream_offset // chunk) % n_slots) * chunk
                self.unit_futs[i] = self.exec.submit(self._write_unit, i, slot)
                next_unit += 1
            return next_unit

        for t in tensors:
            if not t.spec.nbytes:
                continue
            h = xxhash.xxh3_64()
            copy_pieces(sources[t.spec.key], t.stream_offset, chunk, slot_of, h)  # waits for each piece
            self.hashes[t.spec.key] = h.hexdigest()
            submit_ready(t.stream_offset + t.spec.nbytes)
        submit_ready(self.plan.stream_bytes)

    def write_all(self) -> None:
        """Background part: remaining writes, checksums, headers, fsync."""
        if self.direct:
            self.finish_direct()
        if self.deferred:
            self._stage_deferred()
        if not self.streaming and not self.direct:
            for i in self.owned:
                u = self.plan.units[i]
                if i not in self.unit_futs and u.file_index not in self.linked:
                    self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(u.stream_offset))
            staged = [t for t in self.hashed_keys(self._mine())
                      if t.spec.nbytes and t.spec.key not in self.hashes]  # not hashed while staged (_copy_and_hash)
            self.hashes.update((t.spec.key, h) for t, h in self.batched(
                staged, lambda t: t.spec.nbytes,
                lambda t: xxhash.xxh3_64(self.view[self._at(t.stream_offset):self._at(t.stream_offset) + t.spec.nbytes]
                                         ).hexdigest(),
                wait=False).items())
        for fut in self.unit_futs.values():
            fut.exception()
        if self.first_exc is not None:
            raise self.first_exc
        for fut in self.unit_futs.values():
            fut.result()
        self.hashes = {k: (v.result() if isinstance(v, _Pick) else v) for k, v in self.hashes.items()}
        if self.deferred:
            self._check_deferred()
        self._release()
        writers = [w for w in self.writers if w is not None]
        if self.part.leader:
            for w, f in zip(self.writers, self.plan.files):
                if w is not None:
                    write_all(self.be, w.fd, memoryview(f.prefix), 0)  # buffered fd: bytes are not page aligned
                    self.bytes_written += len(f.prefix)
        list(self.exec.map(lambda w: w.sync(), writers))

    def _release(self) -> None:
        """Hand the staging buffer back to the pool (once)."""
        self.buf = self.view = None
        if self.held:
            self.held = False
            self.pool.release()

    def close(self, strict: bool = False) -> None:
        """Close files and threads; safe on any path. ``strict``: re-raise the first close() error
        (a write error reported only at close, e.g. NFS or quota, must fail the save)."""
        err: OSError | None = None
        for w in self.writers:
            if w is None:
                continue
            try:
                w.close()
            except OSError as e:
                err = err or e
        self.exec.shutdown(wait=True, cancel_futures=True)
        self._release()
        self.tier.done(stored=strict and err is None and self.first_exc is None)
        if strict and err is not None:
            raise err


#: Bytes of tensors hashed per I/O-pool task (tiny tasks cost more in scheduling than in hashing).
_BATCH_BYTES = 16 << 20


class _Pick:
    """Element ``i`` of a future's list result (one batch of :meth:`SaveJob.batched`)."""

    __slots__ = ("fut", "i")

    def __init__(self, fut: Future, i: int):
        self.fut, self.i = fut, i

    def result(self) -> Any:
        return self.fut.result()[self.i]
