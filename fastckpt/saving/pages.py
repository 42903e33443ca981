"""The chunks of sharded tensors (DTensors) in full-tensor files: who writes each page, and one rank's writes.

A save of a state holding DTensors writes the same files as a one-process save of the full
tensors (the plan of :func:`fastckpt.format.layout.plan_save`); each rank writes the chunks it
holds (:func:`assign_writers`: one holder per chunk; the DCP drop-in: DCP's planner decides).
A chunk (``offsets``, ``shape`` in elements, inside a tensor of shape ``S``) covers one or
more *runs*: contiguous byte ranges of the file. A chunk spanning every trailing dim from
some dim ``k`` on (a ``Shard(0)`` piece: ``k = 0``) is one run per index of the dims before
``k`` (one range in all for ``Shard(0)``, one per row for ``Shard(1)`` of a matrix).

Pages (4096 bytes of a file) have exactly one writer, so O_DIRECT writes stay aligned and
network file systems that cache whole pages (NFS, Lustre) never see two clients write one
page: the writer of a page is the rank of the run that holds the page's first byte. The runs
tile the data region (tensors are back to back, chunks tile each tensor), so a run's pages
from its first page boundary on are its own; only its *head*, the bytes before that boundary,
can fall in a page of another rank, which then gets those bytes from the run's rank.

One rank's part (:class:`PageJob`), by step of :mod:`fastckpt.saving.saver`:

1. ``stage`` (the call): acquire the saver's staging buffer and copy this rank's bytes straight
   into the pages it writes (one host copy: ``Shard(0)``: one range; ``Shard(1)``: a range per
   row); keep the head bytes that belong to other ranks' pages. ``direct`` (a blocking save whose
   files take buffered writes, :meth:`PageJob.can_write_direct`): no staging, the runs are written
   from the local tensors' memory in step 3, and only the head bytes are copied;
2. ``send_edges`` (background): publish them (``edge/{src}/{dst}`` in the save's store session;
   a failed rank publishes a failure marker instead, so nobody waits for it);
3. ``write``: take the other ranks' edge bytes, ``pwrite`` each page span with the engine's
   :class:`~fastckpt.storage.io.FileWriter` (O_DIRECT where asked: spans are page aligned in
   the file and in memory), each write paced by the tier arbiter, ``fsync``;
4. ``hashes``: xxh3-64 of each chunk's elements in row-major order (the bytes of
   ``full[region].contiguous()``: the manifest's per-chunk checksum), read from the staged pages.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..coordination import Session
from ..format.dtypes import itemsize, str_to_dtype
from ..format.layout import SavePlan
from ..storage.io import FileWriter, default_threads, get_backend, group_by_bytes, memory_backed, write_all
from ..device import AllOf, to_host
from ..errors import PeerFailedError
from ..storage.memory import needs_pinned
from ..storage.staging import StagingPool
from ..storage.store import LOCAL
from ..storage.tier import tier_for
from .direct import DIRECT_MIN_BYTES, changed_in_place, plain_cpu
from .options import SaveOptions

#: Bytes of one page: the unit of single-writer ownership (O_DIRECT alignment, NFS/Lustre caching).
PAGE = 4096


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor written by one rank.

    Attributes:
        key: key path of the tensor (a spec key of the plan).
        offsets: global element index of the chunk's first element, one int per dim.
        shape: chunk shape (elements per dim).
        rank: the rank that writes it (:func:`assign_writers`, or DCP's global plan in the DCP drop-in).
    """

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int

    @property
    def numel(self) -> int:
        """Elements in the chunk."""
        return math.prod(self.shape)


def chunk_runs(shape: tuple[int, ...], esize: int, start: int, offsets: tuple[int, ...],
               size: tuple[int, ...]) -> list[tuple[int, int]]:
    """Absolute byte ranges ``[a, b)`` of a chunk in a file, in the chunk's row-major order.

    Args:
        shape: the full tensor's shape; ``esize``: bytes per element; ``start``: file offset of
            the tensor's first byte.
        offsets, size: the chunk's box (elements).
    """
    n = len(shape)
    if n == 0:
        return [(start, start + esize)]
    if math.prod(size) == 0:
        return []
    k = n - 1
    while k > 0 and size[k] == shape[k] and offsets[k] == 0:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    run = size[k] * strides[k] * esize
    base = offsets[k] * strides[k]
    out = []
    for idx in itertools.product(*(range(offsets[d], offsets[d] + size[d]) for d in range(k))):
        e = base + sum(i * strides[d] for d, i in enumerate(idx))
        a = start + e * esize
        out.append((a, a + run))
    return out


@dataclass
class RankLayout:
    """What one rank copies, sends, receives and writes (see the module docstring).

    Attributes:
        spans: ``(file index, A, B, buffer offset)``: byte ranges of the pages this rank writes
            (``A`` page aligned, ``B`` page aligned or the file's end), placed page aligned in
            its staging buffer.
        buffer_bytes: size of that buffer.
        copies: ``(chunk index, source byte offset, nbytes, buffer offset)`` of its own bytes
            that land in its own pages.
        sends: destination rank -> ``(chunk index, source byte offset, nbytes)`` of head bytes
            that land in that rank's pages, in the order the destination expects them.
        recvs: source rank -> ``(buffer offset, nbytes)`` of bytes it receives, in blob order.
        chunks: indexes of the chunks this rank writes.
    """

    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    buffer_bytes: int = 0
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)
    sends: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    recvs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    chunks: list[int] = field(default_factory=list)

    @property
    def written_bytes(self) -> int:
        """Bytes of file this rank writes itself."""
        return sum(b - a for _, a, b, _ in self.spans)


def check_tiling(plan: SavePlan, chunks: list[Chunk]) -> None:
    """Raise ``ValueError`` unless the chunks of each planned tensor tile it exactly (element counts
    add up, every box inside the tensor); DCP's planner validates overlaps."""
    specs = {t.spec.key: t.spec for f in plan.files for t in f.tensors}
    count: dict[str, int] = {}
    for c in chunks:
        s = specs.get(c.key)
        if s is None:
            raise ValueError(f"chunk of {c.key!r}: no such tensor in the plan")
        if len(c.offsets) != len(s.shape) or any(o < 0 or o + n > m for o, n, m in zip(c.offsets, c.shape, s.shape)):
            raise ValueError(f"chunk of {c.key!r} at {list(c.offsets)} shape {list(c.shape)} leaves tensor shape "
                             f"{list(s.shape)}")
        count[c.key] = count.get(c.key, 0) + c.numel
    for k, s in specs.items():
        if count.get(k, 0) != math.prod(s.shape):
            raise ValueError(f"chunks of {k!r} cover {count.get(k, 0)} of {math.prod(s.shape)} elements")


def rank_layout(plan: SavePlan, chunks: list[Chunk], rank: int) -> RankLayout:
    """The :class:`RankLayout` of ``rank`` (every rank computes its own alike from the same inputs)."""
    where = {t.spec.key: (fi, t) for fi, f in enumerate(plan.files) for t in f.tensors}
    by_file: dict[int, list[tuple[int, int, int, int, int]]] = {}  # fi -> (a, b, rank, chunk index, src offset)
    for ci, c in enumerate(chunks):
        fi, t = where[c.key]
        es = itemsize(str_to_dtype(t.spec.dtype, tensor=c.key))
        src = 0
        for a, b in chunk_runs(t.spec.shape, es, t.file_offset, c.offsets, c.shape):
            by_file.setdefault(fi, []).append((a, b, c.rank, ci, src))
            src += b - a
    out = RankLayout(chunks=[i for i, c in enumerate(chunks) if c.rank == rank])
    for fi in sorted(by_file):
        runs = sorted(by_file[fi])
        starts = [r[0] for r in runs]
        end = plan.files[fi].size

        def owner(page_start: int) -> int:
            return runs[bisect.bisect_right(starts, page_start) - 1][2]

        pages: list[tuple[int, int]] = []  # page ranges [p0, p1) this rank writes
        for a, b, r, ci, src in runs:
            h = min(b, -(-a // PAGE) * PAGE)  # end of the head (bytes before the first page boundary)
            if h > a:
                o = owner(a - a % PAGE)
                if r == rank or o == rank:
                    if r == rank and o == rank:
                        out.copies.append((ci, src, h - a, _Pos(fi, a)))  # type: ignore[arg-type]
                    elif r == rank:
                        out.sends.setdefault(o, []).append((ci, src, h - a))
                    else:
                        out.recvs.setdefault(r, []).append((_Pos(fi, a), h - a))  # type: ignore[arg-type]
            if r == rank and b > h:
                out.copies.append((ci, src + h - a, b - h, _Pos(fi, h)))  # type: ignore[arg-type]
                p0, p1 = h // PAGE, -(-b // PAGE)
                if pages and pages[-1][1] >= p0:
                    pages[-1] = (pages[-1][0], max(pages[-1][1], p1))
                else:
                    pages.append((p0, p1))
        for p0, p1 in pages:
            out.spans.append((fi, p0 * PAGE, min(p1 * PAGE, end), out.buffer_bytes))
            out.buffer_bytes += (p1 - p0) * PAGE
    span_starts = [(fi, a) for fi, a, _, _ in out.spans]

    def at(p: _Pos) -> int:
        i = bisect.bisect_right(span_starts, (p.fi, p.x)) - 1
        fi, a, b, off = out.spans[i]
        if fi != p.fi or not a <= p.x < b:
            raise AssertionError(f"byte {p.x} of file {fi} lies in no page of rank {rank}")  # a planning bug
        return off + p.x - a

    out.copies = [(ci, s, n, at(p)) for ci, s, n, p in out.copies]
    out.recvs = {r: [(at(p), n) for p, n in v] for r, v in out.recvs.items()}
    return out


@dataclass(frozen=True, order=True)
class _Pos:
    fi: int
    x: int


def assign_writers(held: list[list[list]]) -> list[Chunk]:
    """One writer per chunk: ``held[r]`` lists ``[key, offsets, shape]`` of the chunks rank ``r``
    holds (a replicated chunk: several ranks); each goes to the holder with the fewest bytes
    assigned so far (ties: the lowest rank), in order of first appearance. Pure: every rank
    computes the same list from the same inputs. Zero-element chunks of non-scalars are left out."""
    holders: dict[tuple, list[int]] = {}
    for r, items in enumerate(held):
        for key, offs, shape in items:
            holders.setdefault((key, tuple(offs), tuple(shape)), []).append(r)
    load = [0] * len(held)
    out = []
    for (key, offs, shape), ranks in holders.items():
        n = math.prod(shape)
        if not n and shape:
            continue
        r = min(ranks, key=lambda x: (load[x], x))
        load[r] += n
        out.append(Chunk(key, offs, shape, r))
    return out


def create_files(plan: SavePlan, folder: str, opts: SaveOptions) -> int:
    """Create (preallocate, except on memory-backed tiers) every file of ``plan`` in ``folder`` and
    write its header once (the leader of a chunked save); returns the header bytes written. Only a file
    without data bytes is fsynced here: the others are fsynced by the ranks that write their data
    (an fsync covers the whole file, the header written here before any of them starts included),
    so no fsync stall lands in the save's blocking part."""
    be = get_backend(opts.io.io_backend)
    prealloc = not memory_backed(folder)
    for f in plan.files:
        w = LOCAL.open_write(os.path.join(folder, f.name), f.size, create=True, preallocate=prealloc, backend=be)
        try:
            write_all(be, w.fd, memoryview(f.prefix), 0)
            if f.size == f.data_offset:
                w.sync()
        finally:
            w.close()
    return sum(len(f.prefix) for f in plan.files)


_OK, _FAILED = b"\x00", b"\x01"


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order as a flat ``uint8`` tensor on its device (a view
    when ``t`` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class PageJob:
    """One rank's part of one chunked save (see the module docstring).

    Args:
        plan: the full-tensor plan (the same on every rank).
        chunks: every chunk of the save and the rank writing it (the same on every rank).
        rank: this rank; ``folder``: the temporary folder holding the files (set before ``write``).
        opts: the save's options (``o_direct``, ``io_backend``, ``threads``, ``chunk_bytes``).
        pool: the saver's staging memory; ``sess``: the save's store session (edge bytes).
    """

    def __init__(self, plan: SavePlan, chunks: list[Chunk], rank: int, folder: str | None, opts: SaveOptions,
                 pool: StagingPool, sess: Session):
        self.plan, self.chunks, self.rank, self.folder = plan, chunks, rank, folder
        self.opts, self.pool, self.sess = opts, pool, sess
        self.lay: RankLayout = _layout(plan, chunks, rank)
        self.buf: torch.Tensor | None = None
        self.held = False
        self.heads: dict[int, bytes] = {}  # destination rank -> head bytes of its pages (edge blob)
        self.head_pieces: dict[int, list[tuple[int, bytes]]] = {}  # chunk -> (source offset, head bytes) sent
        self.sent: set[int] = set()
        self.bytes_written = 0
        self._hashes: dict[int, str] | None = None
        self.staged = threading.Event()  # set at the call: nothing of the sources is read after it
        self.staged.set()
        self.deferred: dict = {}  # (nothing is deferred on this route)
        self.direct = False  # written from the sources' own memory (stage(direct=True)); staged once written
        self.src: dict[int, Any] = {}  # direct: chunk index -> its bytes (numpy uint8 view of the source)
        self.versions: dict[int, tuple[Any, int]] = {}  # direct: chunk index -> (source, version counter)

    def can_write_direct(self, sources: dict[str, Any], path: str) -> bool:
        """True when :meth:`stage` may leave this rank's chunks in the sources' own memory (``direct``):
        the files at ``path`` (the checkpoint folder, or where it will be) take buffered writes anyway (a
        memory-backed tier, or ``o_direct=False``), every chunk it writes is a
        :func:`~fastckpt.saving.direct.plain_cpu` tensor and its runs are
        :data:`~fastckpt.saving.direct.DIRECT_MIN_BYTES` or more on average (``Shard(1)`` pieces of a
        matrix are one run per row: staged, then written in large requests)."""
        lay = self.lay
        if lay.copies and sum(n for _, _, n, _ in lay.copies) < DIRECT_MIN_BYTES * len(lay.copies):
            return False
        if not all(isinstance(t, torch.Tensor) and plain_cpu(t) for t in (sources[self.chunks[ci].key] for ci in lay.chunks)):
            return False
        return self.opts.io.o_direct is False or memory_backed(path)

    def stage(self, sources: dict[str, torch.Tensor], direct: bool = False) -> None:
        """Copy this rank's chunks (``sources``: key path -> its local tensor, any device) straight into
        the pages it writes in the staging buffer, and keep the head bytes of other ranks' pages; returns
        once every copy is complete (the caller may change the tensors then).

        ``direct`` (a blocking save whose chunks pass :meth:`can_write_direct`): copy nothing but the
        head bytes; :meth:`write` writes the rest from the sources' memory and :attr:`staged` is set
        once it has (the caller must not change the tensors before)."""
        lay = self.lay
        flat: dict[int, torch.Tensor] = {}
        for ci in lay.chunks:
            c = self.chunks[ci]
            t = sources[c.key]
            if tuple(t.shape) != c.shape:
                raise ValueError(f"local tensor of {c.key!r} has shape {list(t.shape)}, its chunk {list(c.shape)}")
            flat[ci] = _flat(t)
        if direct:
            self.direct = True
            self.staged.clear()
            self.src = {ci: f.numpy() for ci, f in flat.items()}
            for ci in lay.chunks:
                t = sources[self.chunks[ci].key]
                try:
                    self.versions[ci] = (t, t._version)
                except (RuntimeError, TypeError):  # inference tensors have no version counter
                    pass
            copies = []
        else:
            self.buf, _ = self.pool.acquire(lay.buffer_bytes, needs_pinned(flat.values()))
            self.held = True
            copies = [to_host(self.buf[off:off + n], flat[ci][s:s + n]) for ci, s, n, off in lay.copies]
        for dst, items in lay.sends.items():
            parts = []
            for ci, s, n in items:
                b = flat[ci][s:s + n].cpu().numpy().tobytes()
                self.head_pieces.setdefault(ci, []).append((s, b))
                parts.append(b)
            self.heads[dst] = b"".join(parts)
        AllOf(copies).wait()  # every device copy complete before any byte is hashed or written

    def send_edges(self) -> None:
        """Publish the head bytes of other ranks' pages (other ranks' ``write`` waits for them)."""
        for dst, blob in self.heads.items():
            self.sess.publish_bytes(f"edge/{self.rank}/{dst}", _OK + blob)
            self.sent.add(dst)

    def fail_edges(self, exc: BaseException) -> None:
        """Tell every rank still waiting for this rank's edge bytes that it failed (never raises)."""
        for dst in self.lay.sends:
            if dst not in self.sent:
                try:
                    self.sess.publish_bytes(f"edge/{self.rank}/{dst}", _FAILED + f"{type(exc).__name__}: {exc}".encode())
                except Exception:
                    pass

    def write(self) -> None:
        """Take the other ranks' edge bytes, write every page span (about ``chunk_bytes`` per task on the
        I/O pool) while the chunks are hashed, fsync. Each write is paced by the tier arbiter
        (latency-critical readers first, within the save's bound) and the bytes are claimed on it.

        Raises:
            fastckpt.errors.SourceChangedError: (``direct``) a source tensor was written in place during the save."""
        lay = self.lay
        received: list[tuple[int, memoryview]] = []  # (buffer offset, bytes) of the other ranks' heads
        for src, items in sorted(lay.recvs.items()):
            data = self.sess.wait_bytes(f"edge/{src}/{self.rank}", f"waiting for rank {src}'s edge bytes")
            if data[:1] != _OK:
                raise PeerFailedError(f"rank {src} failed before handing over its edge bytes: {data[1:].decode()}", src)
            mv, pos = memoryview(data)[1:], 0
            for off, n in items:
                received.append((off, mv[pos:pos + n]))
                pos += n
        step = self.opts.io.chunk_bytes
        if self.direct:  # each run from its source's memory, each head at its place: buffered writes
            starts = [off for _, _, _, off in lay.spans]

            def place(off: int) -> tuple[int, int]:
                fi, a, _, soff = lay.spans[bisect.bisect_right(starts, off) - 1]
                return fi, a + off - soff
            segs = [(*place(off), memoryview(self.src[ci])[s:s + n]) for ci, s, n, off in lay.copies]
            segs += [(*place(off), mv) for off, mv in received]
            o_direct = False
        else:
            view = memoryview(self.buf.numpy()) if lay.buffer_bytes else None
            for off, mv in received:
                view[off:off + len(mv)] = mv
            segs = [(fi, a, view[off:off + b - a]) for fi, a, b, off in lay.spans]
            o_direct = self.opts.io.o_direct is not False
        pieces = [(fi, x + d, mv[d:d + step], min(step, len(mv) - d)) for fi, x, mv in segs for d in range(0, len(mv), step)]
        # each rank starts at another file: writes into one file serialise on its inode lock in tmpfs (and
        # on a file's lock in network file systems), so the ranks take the files in rotated order
        files = sorted({p[0] for p in pieces})
        world = 1 + max(c.rank for c in self.chunks) if self.chunks else 1
        first = (self.rank * len(files)) // world if files else 0
        turn = {fi: (i - first) % len(files) for i, fi in enumerate(files)}
        pieces.sort(key=lambda p: (turn[p[0]], p[1]))
        self._write_pieces(pieces, o_direct)
        if self.direct:
            for ci, (t, was) in self.versions.items():
                if t._version != was:
                    raise changed_in_place(f"{self.chunks[ci].key!r} (this rank's chunk at "
                                           f"{list(self.chunks[ci].offsets)})", was, t._version, self.folder)
            self.staged.set()

    def _write_pieces(self, pieces: list[tuple[int, int, memoryview, int]], o_direct: bool) -> None:
        """Write ``(file index, file offset, bytes, nbytes)`` pieces on the I/O pool while the chunks are
        hashed, fsync every file; paced and claimed on the tier."""
        be = get_backend(self.opts.io.io_backend)
        writers: dict[int, FileWriter] = {}
        # rank 0 claims every shard file (it created them), as the plain route's leader does
        tier = tier_for(self.folder).checkpoint(self.folder, sum(f.size for f in self.plan.files) if self.rank == 0 else 0)
        stored = False
        try:
            for fi in sorted({p[0] for p in pieces}):
                pf = self.plan.files[fi]
                writers[fi] = LOCAL.open_write(os.path.join(self.folder, pf.name), pf.size,
                                               o_direct=o_direct, create=False, backend=be)
            tasks = [t for t in group_by_bytes(pieces, self.opts.io.chunk_bytes) if t]  # a Shard(1) chunk: many spans

            def run(task: list) -> None:
                for fi, x, mv, n in task:
                    with tier.write(n):  # the tier: readers first (bounded)
                        writers[fi].write(mv, x)
            with ThreadPoolExecutor(self.opts.io.threads or default_threads(), thread_name_prefix="fastckpt-io") as ex:
                futs = [ex.submit(run, t) for t in tasks]
                self.hashes()  # while the writes are in flight
                for f in futs:
                    f.result()
                for f in [ex.submit(w.sync) for w in writers.values()]:
                    f.result()
            self.bytes_written = self.lay.written_bytes
            stored = True
        finally:
            tier.done(stored=stored)
            for w in writers.values():
                w.close()

    def hashes(self) -> dict[int, str]:
        """xxh3-64 hex digest of each of this rank's chunks (chunk index -> digest; computed once), read
        from the staged pages and the head bytes handed to other ranks, in the chunk's row-major order."""
        if self._hashes is None:
            arr = self.buf.numpy() if self.buf is not None and self.lay.buffer_bytes else None
            pieces: dict[int, list[tuple[int, Any]]] = {ci: list(self.head_pieces.get(ci, ())) for ci in self.lay.chunks}
            for ci, s, n, off in self.lay.copies:
                pieces[ci].append((s, self.src[ci][s:s + n] if self.direct else arr[off:off + n]))
            out = {}
            for ci, ps in pieces.items():
                h = xxhash.xxh3_64()
                for _, b in sorted(ps, key=lambda p: p[0]):
                    h.update(b)
                out[ci] = h.hexdigest()
            self._hashes = out
        return self._hashes

    def release(self) -> None:
        """Hand the staging buffer back (once); drop the references to direct sources."""
        self.buf = None
        self.src, self.versions = {}, {}
        if self.held:
            self.held = False
            self.pool.release()

    def close(self, strict: bool = False) -> None:
        """Release the staging buffer (files are closed by ``write``); ``strict`` is accepted for the
        saver's abort path."""
        self.release()


#: The last (inputs, layout): a training run saves the same layout every time (layout costs ~0.1 s
#: per 8k chunk rows in Python). One entry per process; layouts are never mutated.
_MEMO: list = [None, None]
_MEMO_LOCK = threading.Lock()


def _layout(plan: SavePlan, chunks: list[Chunk], rank: int) -> RankLayout:
    key = (tuple((f.name, f.size, tuple((t.spec.key, t.spec.dtype, t.spec.shape, t.file_offset) for t in f.tensors))
                 for f in plan.files), tuple(chunks), rank)
    with _MEMO_LOCK:
        if _MEMO[0] == key:
            return _MEMO[1]
    lay = rank_layout(plan, chunks, rank)
    with _MEMO_LOCK:
        _MEMO[0], _MEMO[1] = key, lay
    return lay


def run_job(job: PageJob, sources: dict[str, Any]) -> dict[int, str]:
    """``stage`` -> ``send_edges`` -> ``write`` -> ``hashes`` of ``job`` in one go (the DCP drop-in's
    ``write_data``, which DCP calls with tensors that stay unchanged until it returns: the caller's in
    ``dcp.save``, the stager's copies in ``dcp.async_save``); on failure tell the waiting ranks,
    release, re-raise. Where the files take buffered writes (a memory tier or ``o_direct=False``) and
    :meth:`PageJob.can_write_direct` allows it, the chunks are written from the tensors' memory."""
    try:
        job.stage(sources, direct=job.can_write_direct(sources, job.folder))
        job.send_edges()
        job.write()
        return job.hashes()
    except BaseException as e:
        job.fail_edges(e)
        raise
    finally:
        job.release()
