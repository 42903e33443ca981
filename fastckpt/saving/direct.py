"""Direct writes of a blocking save: the files are written from the caller's tensors, not from staging.

:func:`fastckpt.save` waits for the whole save, so it needs no snapshot of the state in the staging
pool: a tensor is cut into pieces of :data:`BOUNCE_BYTES` (page aligned in the file), and the I/O
threads take the pieces in file order, so every thread writes to the end, at most
:func:`direct_lanes` of them at once (the CPUs + 1: each piece is copied and hashed first; one thread per whole
tensor wrote a large tensor at queue depth 1: a state of 512 + 256 MiB saved in 0.50-0.57 s, in
pieces 0.43-0.44 s, in one run; in a later, faster period of the disk both took 0.31-0.37 s). Where the file takes O_DIRECT writes, each piece is first copied into
the thread's small page-aligned buffer (a tensor's memory is almost never page aligned, and O_DIRECT
needs the memory and the file offset aligned), hashed there and written O_DIRECT from it: the
checksum is of the very bytes written, read while they are in the CPU cache, and the buffer is
faulted in once per thread. Elsewhere (tmpfs, ``o_direct=False``) pieces are hashed and written,
buffered, straight from the tensor's own memory. A tensor's pieces update its checksum in order
(:class:`_InOrder`: a piece waits, briefly, for the one before it). Tensors under
:data:`DIRECT_MIN_BYTES` go in runs through the thread's buffer (copied, hashed from there, one write
per run). Nothing is copied into the staging pool: a first save of a process pays no page faults
of fresh staging memory (on a 2-core VM a copy of 1 GiB into fresh memory, 1.3-1.8 s, takes longer
than writing it to disk O_DIRECT, 0.4-0.5 s).

What the caller's tensors may do meanwhile is what ``defer`` allows (:class:`fastckpt.SaveOptions`):
an in-place torch write to a tensor before its bytes are written fails the save with
:class:`~fastckpt.errors.SourceChangedError` (its version counter is compared when every write is
done), nothing committed. A blocking save's caller is waiting, so only another thread can do it.

:class:`DirectWrites` is a part of :class:`fastckpt.saving.job.SaveJob` (its plan, writers, I/O
pool, hashes and ``first_exc``); the saver chooses it through :meth:`DirectWrites.can_write_direct`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
import xxhash

from ..device import AllOf, to_host
from ..errors import SourceChangedError
from ..storage.io import ALIGN, default_threads

#: Tensors from this size on are written from their own memory; smaller ones through the thread's buffer.
DIRECT_MIN_BYTES = 64 << 10
#: Bytes of each I/O thread's page-aligned buffer (O_DIRECT writes; runs of small tensors), and of the
#: pieces a large tensor is written in.
BOUNCE_BYTES = 4 << 20


def direct_lanes(threads: int) -> int:
    """How many of a job's ``threads`` I/O threads write directly at once: at most the CPUs this
    process may run on + 1. Each direct write first copies its piece into a buffer and hashes it
    on the CPU, so more lanes than CPUs only contend for them (and the GIL) and issue the writes
    later. Measured on a 2-core VM (``fastckpt.save`` of a 1.07 GB state, a fresh process each,
    7-8 rotated runs): 8 threads 0.81-0.82 s, 3 lanes 0.72-0.75 s, and 8 threads with at most 3
    writes in flight 0.83 s: the CPUs, not the device's queue depth."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(threads, cpus + 1))


def changed_in_place(what: str, was: int, now: int, folder: str) -> SourceChangedError:
    """The error of a tensor written from its own memory (``what`` names it) whose version counter
    moved from ``was`` to ``now`` while the save wrote it into ``folder``."""
    return SourceChangedError(
        f"{what} was written in place (version counter {was} -> {now}) while fastckpt.save wrote it from its "
        f"own memory into {folder}: the bytes written may mix old and new values; nothing was committed. Do "
        "not change the state from another thread during save")


def plain_cpu(t: torch.Tensor) -> bool:
    """True when ``t``'s memory holds exactly the bytes a save writes for it (a dense, contiguous CPU
    tensor without lazy conjugate / negative bits)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_quantized)


class _InOrder:
    """The xxh3-64 of one tensor written in pieces by several threads: each piece waits for the one
    before it (the pool takes the pieces in order, so that one is being hashed or done), then updates
    the digest. A failed write elsewhere in the job (``job.first_exc``) ends the wait."""

    def __init__(self) -> None:
        self.h = xxhash.xxh3_64()
        self.at = 0  # bytes hashed so far
        self.cond = threading.Condition()

    def update(self, off: int, data: memoryview, last: bool, job: Any) -> str | None:
        """Hash ``data`` (the tensor's bytes from ``off``) once every byte before it is; the hex digest
        after the ``last`` piece, else ``None``."""
        with self.cond:
            while self.at != off:
                if job.first_exc is not None:
                    raise job.first_exc
                self.cond.wait(0.05)
            self.h.update(data)
            self.at += len(data)
            self.cond.notify_all()
            return self.h.hexdigest() if last else None


class DirectWrites:
    """The direct-write half of :class:`~fastckpt.saving.job.SaveJob` (see the module docstring)."""

    def can_write_direct(self, sources: dict) -> bool:
        """True when this job may write ``sources`` directly: it writes every unit (one process), no
        copy is deferred, every tensor it writes is on the CPU and every one of at least
        :data:`DIRECT_MIN_BYTES` is :func:`plain_cpu` (others: device, strided or lazily conjugated
        tensors go through staging, as in :meth:`SaveJob.stage`)."""
        if not self.all_units or self.cons.defer is not None or self.cons.defer_frozen:
            return False
        for f in self.plan.files:
            for t in f.tensors:
                src = sources[t.spec.key]
                if src.device.type != "cpu" or (t.spec.nbytes >= DIRECT_MIN_BYTES and not plain_cpu(src)):
                    return False
        return True

    def write_direct(self, sources: dict, frozen: set[str] = frozenset()) -> None:
        """Start writing every tensor this job writes from ``sources`` (the caller's thread submits the
        tasks to the I/O pool and returns; :meth:`finish_direct` waits for them). The staging pool
        is not touched."""
        tensors = self._mine()
        self.direct = True
        self.direct_sources = sources
        self.direct_bytes = 0
        self.direct_lock = threading.Lock()
        self.bounce = threading.local()
        if self.cache is not None:  # frozen parameters: their hashes let the next save link them
            self.idents.update((t.spec.key, type(self.cache).ident(sources[t.spec.key]))
                               for t in tensors if t.spec.key in frozen)
        self.versions: dict[str, int] = {}
        for t in tensors:
            try:
                self.versions[t.spec.key] = sources[t.spec.key]._version
            except (RuntimeError, TypeError):  # inference tensors have no version counter
                pass
        where = {f.name: i for i, f in enumerate(self.plan.files)}
        tasks: list[list] = []
        run: list = []
        run_bytes, end = 0, -1
        for t in tensors:
            n = t.spec.nbytes
            if not n:
                continue
            if n >= DIRECT_MIN_BYTES:
                seq, off = _InOrder(), 0
                while off < n:  # pieces ending on page boundaries of the file, hashed in order
                    m = min(n - off, BOUNCE_BYTES - (t.file_offset + off) % ALIGN)
                    tasks.append([t, off, m, seq])
                    off += m
                continue
            if run and (t.file != run[0].file or t.file_offset != end or run_bytes + n > BOUNCE_BYTES):
                tasks.append(run)
                run, run_bytes = [], 0
            run.append(t)
            run_bytes += n
            end = t.file_offset + n
        if run:
            tasks.append(run)
        todo = iter([(self.writers[where[task[0].file]], task) for task in tasks])
        take = threading.Lock()

        def lane() -> None:  # takes the tasks in file order until none is left or a write failed
            while True:
                with take:
                    nxt = next(todo, None)
                if nxt is None:
                    return
                self._write_task(*nxt)

        lanes = min(len(tasks), direct_lanes(self.io.threads or default_threads()))
        self.direct_futs: list[Future] = [self.exec.submit(lane) for _ in range(lanes)]

    def _write_task(self, w: Any, task: list) -> None:
        """One task: ``[tensor, offset, nbytes, in order]`` writes a piece of a large tensor
        (:meth:`_write_piece`), a list of small tensors is a run written through the thread's buffer
        (copied, hashed from there, one write)."""
        if self.first_exc is not None:
            raise self.first_exc  # a write already failed: do not keep writing
        try:
            if len(task) == 4 and isinstance(task[3], _InOrder):
                n = self._write_piece(w, *task)
            else:
                n = sum(t.spec.nbytes for t in task)
                buf = self._bounce(n)
                copies, pos = [], 0
                for t in task:
                    copies.append(to_host(buf[pos:pos + t.spec.nbytes], self.direct_sources[t.spec.key]))
                    pos += t.spec.nbytes
                AllOf(copies).wait()  # (CPU: complete at once) nothing hashed or written before
                view = memoryview(buf.numpy())
                pos = 0
                for t in task:
                    self.hashes[t.spec.key] = xxhash.xxh3_64(view[pos:pos + t.spec.nbytes]).hexdigest()
                    pos += t.spec.nbytes
                self._write_paced(w, view, task[0].file_offset)
            with self.direct_lock:
                self.direct_bytes += n
        except BaseException as e:
            with self.exc_lock:
                if self.first_exc is None:
                    self.first_exc = e
            raise

    def _flat(self, t: Any) -> torch.Tensor:
        """The bytes of planned tensor ``t`` (a :func:`plain_cpu` source) as a flat ``uint8`` view of its memory."""
        return self.direct_sources[t.spec.key].detach().reshape(-1).view(torch.uint8)

    def _write_piece(self, w: Any, t: Any, off: int, m: int, seq: "_InOrder") -> int:
        """Hash, then write bytes ``[off, off + m)`` of planned tensor ``t`` at their place in the file;
        returns ``m``. With an O_DIRECT fd the piece (it ends on a page boundary of the file, or at the
        tensor's end) is first copied into the thread's page-aligned buffer and hashed there (the very
        bytes written, still in the cache); without, it is hashed and written (buffered) from the
        tensor's own memory. ``seq`` feeds the tensor's checksum its pieces in order."""
        piece = self._flat(t)[off:off + m]
        if w.dfd < 0:
            data = memoryview(piece.numpy())
        else:
            buf = self._bounce(m)
            to_host(buf, piece, one_thread=True).wait()
            data = memoryview(buf.numpy())
        digest = seq.update(off, data, off + m == t.spec.nbytes, self)
        if digest is not None:
            self.hashes[t.spec.key] = digest
        self._write_paced(w, data, t.file_offset + off)
        return m

    def _write_paced(self, w: Any, data: memoryview, offset: int) -> None:
        """Write ``data`` at byte ``offset`` of ``w``, paced by the tier arbiter (readers first, bounded)."""
        with self.tier.write(len(data)):
            w.write(data, offset)

    def _bounce(self, n: int) -> torch.Tensor:
        """This I/O thread's page-aligned buffer, at least ``n`` bytes (kept for the job's next tasks)."""
        b = getattr(self.bounce, "buf", None)
        if b is None or b.numel() < n:
            raw = torch.empty(max(n, BOUNCE_BYTES) + ALIGN, dtype=torch.uint8)
            a = -raw.data_ptr() % ALIGN
            b = self.bounce.buf = raw[a:a + max(n, BOUNCE_BYTES)]
        return b[:n]

    def finish_direct(self) -> None:
        """Wait for every direct write; raise the first failure, or :class:`SourceChangedError` when a
        tensor was written in place (its version counter moved) while the save read it."""
        futs, self.direct_futs = self.direct_futs, []
        for fut in futs:
            fut.exception()
        if self.first_exc is not None:
            raise self.first_exc
        for fut in futs:
            fut.result()
        self.bytes_written += self.direct_bytes
        sources, self.direct_sources = self.direct_sources, {}
        for k, was in self.versions.items():
            now = sources[k]._version
            if now != was:
                if self.cache is not None:
                    self.cache.forget(k)
                raise changed_in_place(repr(k), was, now, self.tmp)
        self.staged.set()
