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
import os
from dataclasses import dataclass
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import xxhash

from . import dedupe
from ..errors import LinkedTensorChangedError, SourceChangedError
from ..storage.io import FileWriter, default_threads, get_backend, write_all
from ..format.layout import SavePlan
from ..storage.staging import StagingPool, copy_into, copy_pieces

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


class SaveJob:
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
        for a, b in merged:
            self.segs.append((a, b, off))
            off += b - a
        self.seg_starts = [a for a, _, _ in self.segs]
        return off
    def link_unchanged(self, col) -> None:
        """Hard-link files whose bytes equal the previous checkpoint's (see :mod:`fastckpt.saving.dedupe`)."""
        sources = col.sources
        prev = dedupe.previous_manifest(self.cons.link_from)
        cands = dedupe.candidate_files(self.plan.files, prev)
        for i, f in enumerate(self.plan.files):
            keys = [t.spec.key for t in f.tensors]
            if f.name not in cands or any(k not in sources for k in keys):
                continue  # changed, or another rank's local file
            known: dict[str, str | None] = dict.fromkeys(keys)
            if self.cache is not None:
                if any(k in col.trainable for k in keys) or not any(k in col.frozen for k in keys):
                    continue  # no frozen weights to link, or an optimizer steps them: stage
                for k in keys:
                    if k in col.frozen:
                        known[k] = self.cache.lookup(k, sources[k])
                        self.idents[k] = dedupe.HashCache.ident(sources[k])
                if dedupe.CHANGED in known.values():
                    continue  # written in place since the last save: stage it
            todo = [k for k in keys if known[k] is None]  # hashed in parallel: xxhash releases the GIL
            hashes = {**known, **self.batched(todo, lambda k: sources[k].numel() * sources[k].element_size(),
                                              lambda k: dedupe.source_hash(sources[k]))}
            if dedupe.identical(f, hashes, prev) and dedupe.link_file(self.cons.link_from, self.tmp, f.name):
                self.linked.add(i)
                self.hashes.update(hashes)
                self.to_verify += [(k, sources[k], known[k], sources[k]._version) for k in keys if known[k]]

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

    def start_verify(self) -> None:
        """Background half of ``link_check="version"``, started before the writes (it overlaps
        them): re-hash every tensor linked on its version counter alone."""
        items, self.to_verify = self.to_verify, []

        self.verifying = self.batched(items, lambda it: it[1].numel() * it[1].element_size(), _changed,
                                      wait=False)

    def verify_links(self) -> None:
        """Raise :class:`LinkedTensorChangedError` where :meth:`start_verify` found bytes that
        differ although the version counter did not move (a write that bypassed it)."""
        found, self.verifying = self.verifying, {}
        suspects = [it for it, res in found.items() if res.result()]
        # an in-place op running right now bumps the counter only when it is done: look again
        for pause in (0.001, 0.01, 0.1, 1.0):
            if not suspects:
                break
            time.sleep(pause)
            suspects = [it for it in suspects if _changed(it)]
        bad = [it[0] for it in suspects]
        if bad:
            for k in bad:
                self.cache.forget(k)
            raise LinkedTensorChangedError(
                f"{len(bad)} tensor(s) hard-linked as unchanged from {self.cons.link_from} (same storage "
                f"and version counter as at the last save) have different bytes, e.g. {bad[0]!r}: they "
                "were written without the version counter seeing it (.data, a NumPy view); nothing was "
                "committed; save with link_check='hash'")

    def record_hashes(self) -> None:
        """Give the cache the hash of every tensor this save hashed, for the next save."""
        if self.cache is None:
            return
        for k, ident in self.idents.items():
            h = self.hashes.get(k)
            if isinstance(h, str):
                self.cache.record(k, ident, h)

    def open_files(self) -> None:
        """Leader: create (and preallocate) every file of the folder not linked; other ranks:
        open the existing files holding a unit they write."""
        p = self.plan
        if self.part.leader:
            todo = [i for i in self.files if i not in self.linked]
        else:
            todo = sorted({p.units[i].file_index for i in self.owned} - self.linked)
        for i in todo:
            self.writers[i] = FileWriter(self.be, os.path.join(self.tmp, p.files[i].name), p.files[i].size,
                                         self.io.o_direct is not False, create=self.part.leader)

    def _write_unit(self, i: int, slot_off: int) -> None:
        if self.first_exc is not None:
            raise self.first_exc  # a write already failed: do not keep writing
        u = self.plan.units[i]
        try:
            self.writers[u.file_index].write(self.view[slot_off:slot_off + u.nbytes], u.file_offset)
            self.bytes_written += u.nbytes
        except BaseException as e:
            with self.exc_lock:
                if self.first_exc is None:
                    self.first_exc = e
            raise

    def stage(self, sources: dict, frozen: set[str] = frozenset(), trainable: set[str] = frozenset()) -> None:
        """Copy every tensor into the staging buffer (the caller's blocking part)."""
        p, chunk = self.plan, self.plan.chunk_bytes
        budget = self.io.staging_bytes
        tensors = self._mine()
        need = self._layout(tensors)
        self.streaming = budget is not None and budget < need
        size = max(2, budget // chunk) * chunk if self.streaming else need
        self.buf, self.view = self.pool.acquire(size)
        self.held = True
        if self.cache is not None:  # frozen parameters: their hashes let the next save link them
            self.idents.update((t.spec.key, dedupe.HashCache.ident(sources[t.spec.key]))
                               for t in tensors if t.spec.key in frozen)
        host = all(getattr(v, "device", None) is None or v.device.type == "cpu" for v in sources.values())
        if host and not self.streaming and (self.cons.defer is not None
                                            or (self.cache is not None and self.cons.defer_frozen)):
            self._defer(tensors, sources, frozen, trainable)
            tensors = [t for t in tensors if t.spec.key not in self.deferred]
        if not self.streaming:
            # host sources: each write unit goes out as soon as its bytes are staged, so the
            # disk works while the caller copies (save total ~ max(copy, write), not the sum)
            early = self.cons.early_writes and host and not self.deferred
            units, owned, nxt = self.plan.units, self.owned, 0
            for run in _copy_runs(tensors, sources):
                b = self._copy_run(run, sources)
                if early:
                    while nxt < len(owned) and units[owned[nxt]].stream_offset + units[owned[nxt]].nbytes <= b:
                        i = owned[nxt]
                        if units[i].file_index not in self.linked:
                            self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(units[i].stream_offset))
                        nxt += 1
            _sync_devices(sources)
            return
        self._stage_streaming(tensors, sources, size // chunk)

    def _copy_run(self, run: list, sources: dict) -> int:
        """Stage one run of :func:`_copy_runs`; returns the stream offset just past it."""
        a, b = run[0].stream_offset, run[-1].stream_offset + run[-1].spec.nbytes
        x = self._at(a)
        if len(run) == 1:
            copy_into(self.buf[x:x + b - a], sources[run[0].spec.key])
        else:  # one op for many small tensors: per-tensor views and copies cost ~10 us each
            torch.cat([sources[t.spec.key].reshape(-1) for t in run],
                      out=self.buf[x:x + b - a].view(sources[run[0].spec.key].dtype))
        return b

    def _defer(self, tensors: list, sources: dict, frozen: set[str], trainable: set[str]) -> None:
        """Leave to :meth:`write_all` the copy of (``defer_frozen``) every frozen tensor whose
        recorded hash its version counter vouches for (checked against that hash there) and of
        every tensor ``opts.defer`` accepts (checked on its version counter)."""
        by_hash = self.cache is not None and self.cons.defer_frozen
        pick = self.cons.defer
        for t in tensors:
            k = t.spec.key
            src = sources[k]
            if src.device.type != "cpu" or not t.spec.nbytes:
                continue
            try:
                version = src._version
            except (RuntimeError, TypeError):  # inference tensors have no version counter
                continue
            if by_hash and k in frozen:
                h = self.cache.lookup(k, src)
                if h is not None and h is not dedupe.CHANGED:
                    self.deferred[k] = (h, version)
                    continue
            if pick is not None and k not in frozen and pick(k, k in trainable):
                self.deferred[k] = (None, version)
        if self.deferred:
            self.sources = sources

    def _stage_deferred(self) -> None:
        """Background half of ``defer`` / ``defer_frozen``: copy the deferred tensors into their staging
        slots, submitting each write unit once every byte of it is staged."""
        p = self.plan
        tensors = sorted((t for f in p.files for t in f.tensors if t.spec.key in self.deferred),
                         key=lambda t: t.stream_offset)
        spans = [(t.stream_offset, t.stream_offset + t.spec.nbytes) for t in tensors]
        starts = [a for a, _ in spans]
        waiting = []  # (units that overlap a deferred tensor, in stream order)
        for i in self.owned:
            u = p.units[i]
            if u.file_index in self.linked:
                continue
            j = bisect.bisect_right(starts, u.stream_offset + u.nbytes - 1) - 1
            overlaps = False
            while j >= 0 and spans[j][1] > u.stream_offset:
                overlaps = spans[j][0] < u.stream_offset + u.nbytes
                if overlaps:
                    break
                j -= 1
            if overlaps:
                waiting.append(i)
            else:
                self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(u.stream_offset))
        nxt = 0
        for run in _copy_runs(tensors, self.sources):
            self._check_versions(run)
            if len(run) == 1 and run[0].spec.nbytes >= _FUSED_BYTES and self.sources[run[0].spec.key].is_contiguous():
                b = self._copy_and_hash(run[0])
            else:
                b = self._copy_run(run, self.sources)
            while nxt < len(waiting) and p.units[waiting[nxt]].stream_offset + p.units[waiting[nxt]].nbytes <= b:
                i = waiting[nxt]
                self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(p.units[i].stream_offset))
                nxt += 1
        # an in-place write that finished during a copy; one still running now bumps the counter
        # only when done, indistinguishable from a write after staged (allowed): not seen
        self._check_versions(tensors)
        self.sources = {}
        self.staged.set()
        for i in waiting[nxt:]:
            self.unit_futs[i] = self.exec.submit(self._write_unit, i, self._at(p.units[i].stream_offset))

    def _copy_and_hash(self, t) -> int:
        """Stage one large deferred tensor piece by piece, hashing each piece right after its copy
        (from the CPU cache: one pass over memory fewer than copying, then hashing the staged bytes).
        One thread (NumPy's copy, GIL released): this runs while training computes, and torch's
        multi-threaded copy takes more from it. Measured on 2 cores, 327 MB staged every 0.3 s
        while the main thread ran 60 MLP forward/backward passes (0.37 s alone): 0.56-0.58 s with
        NumPy pieces of 512 KiB or 4 MiB, 0.68 s with torch pieces, 0.67 s with a torch copy then
        pooled hashing."""
        src = self.sources[t.spec.key].reshape(-1).view(torch.uint8).numpy()
        dst = np.frombuffer(self.view, dtype=np.uint8)
        h = xxhash.xxh3_64()
        a, n = self._at(t.stream_offset), t.spec.nbytes
        for off in range(0, n, _FUSED_PIECE):
            m = min(_FUSED_PIECE, n - off)
            np.copyto(dst[a + off:a + off + m], src[off:off + m])
            h.update(self.view[a + off:a + off + m])
        self.hashes[t.spec.key] = h.hexdigest()
        return t.stream_offset + n

    def _check_versions(self, tensors: list) -> None:
        for t in tensors:
            k = t.spec.key
            was, now = self.deferred[k][1], self.sources[k]._version
            if now != was:
                if self.cache is not None:
                    self.cache.forget(k)
                raise SourceChangedError(
                    f"{k!r} was written in place (version counter {was} -> {now}) after the save "
                    f"call and before its background copy into staging finished "
                    f"(defer/defer_frozen) for {self.tmp}: its call-time bytes are gone; nothing was committed")

    def _check_deferred(self) -> None:
        """Raise :class:`LinkedTensorChangedError` where a deferred tensor's staged bytes do not
        hash to the value recorded when its version counter was last seen."""
        bad = [k for k, (h, _) in self.deferred.items() if h is not None and self.hashes.get(k) != h]
        if bad:
            for k in bad:
                self.cache.forget(k)
            raise LinkedTensorChangedError(
                f"{len(bad)} frozen tensor(s) copied in the background (defer_frozen=True, same storage "
                f"and version counter as when last hashed) have different bytes, e.g. {bad[0]!r}: they "
                "were written without the version counter seeing it (.data, a NumPy view); nothing was "
                "committed; save with link_check='hash'")

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
            copy_pieces(sources[t.spec.key], t.stream_offset, chunk, slot_of, h)
            _sync_devices({0: sources[t.spec.key]})
            self.hashes[t.spec.key] = h.hexdigest()
            submit_ready(t.stream_offset + t.spec.nbytes)
        submit_ready(self.plan.stream_bytes)

    def write_all(self) -> None:
        """Background part: remaining writes, checksums, headers, fsync."""
        if self.deferred:
            self._stage_deferred()
        if not self.streaming:
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
        if strict and err is not None:
            raise err


def _changed(item: tuple) -> bool:
    """True if a ``(key, tensor, xxh3, version at the call)`` item now hashes differently while
    its version counter has not moved."""
    _, t, want, version = item
    return t._version == version and dedupe.source_hash(t) != want


#: Bytes of one batched staging copy (small enough for writes to start while the caller copies).
_RUN_BYTES = 64 << 20
#: Tensors below this size are staged in batches (their per-tensor overhead exceeds the copy).
_SMALL_BYTES = 1 << 20


def _copy_runs(tensors: list, sources: dict) -> list[list]:
    """Split planned tensors (stream order) into runs that one ``torch.cat`` can stage: small
    (< :data:`_SMALL_BYTES`), same dtype, contiguous CPU sources, back to back in the stream,
    <= :data:`_RUN_BYTES` per run. Large tensors stay alone: their ``copy_`` runs on all
    intra-op threads (``cat`` copies on one, which is slower into freshly faulted memory)."""
    runs: list[list] = []
    end, dtype, nbytes = -1, None, 0
    for t in tensors:
        src = sources[t.spec.key]
        ok = src.device.type == "cpu" and src.is_contiguous() and 0 < t.spec.nbytes < _SMALL_BYTES
        if ok and runs and t.stream_offset == end and src.dtype == dtype and nbytes + t.spec.nbytes <= _RUN_BYTES:
            runs[-1].append(t)
            nbytes += t.spec.nbytes
        else:
            runs.append([t])
            nbytes = t.spec.nbytes
            dtype = src.dtype if ok else None  # a device/strided/empty source stays alone
        end = t.stream_offset + t.spec.nbytes if ok else -1
    return runs


#: Deferred tensors from this size on are copied and hashed piece by piece (:meth:`SaveJob._copy_and_hash`;
#: smaller ones are batched by ``torch.cat`` and hashed on the pool).
_FUSED_BYTES = 1 << 20
#: Piece of :meth:`SaveJob._copy_and_hash`: hashed right after its copy, from the CPU cache; few
#: pieces per tensor, since each takes the GIL (a Python-bound main thread holds it up to 5 ms).
_FUSED_PIECE = 4 << 20

#: Bytes of tensors hashed per I/O-pool task (tiny tasks cost more in scheduling than in hashing).
_BATCH_BYTES = 16 << 20


class _Pick:
    """Element ``i`` of a future's list result (one batch of :meth:`SaveJob.batched`)."""

    __slots__ = ("fut", "i")

    def __init__(self, fut: Future, i: int):
        self.fut, self.i = fut, i

    def result(self) -> Any:
        return self.fut.result()[self.i]


def _sync_devices(sources: dict) -> None:
    for t in sources.values():
        if t.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
            return
