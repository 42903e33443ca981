"""Direct writes of a blocking save: the files are written from the caller's tensors, not from staging.

:func:`fastckpt.save` waits for the whole save, so it needs no snapshot of the state in a staging
buffer: every contiguous CPU tensor of at least :data:`DIRECT_MIN_BYTES` is hashed and written
straight from its own memory, piece by piece (:data:`PIECE_BYTES`), each piece hashed right before
the same thread writes it (from the CPU cache, in one pass over memory; buffered writes where the
source's address is not page aligned, as almost every tensor's is not: O_DIRECT needs the memory
and the file offset aligned alike). Smaller tensors are copied in runs of up to ``chunk_bytes`` into
a small buffer of the writing thread and written from there (one write per run), hashed from that
buffer. Nothing is copied into the staging pool: a first save of a process pays no page faults
of fresh staging memory (measured on a 2-core VM: a copy into fresh memory takes longer than
writing the same bytes to disk).

What the caller's tensors may do meanwhile is what ``defer`` allows (:class:`fastckpt.SaveOptions`):
an in-place torch write to a tensor before its bytes are written fails the save with
:class:`~fastckpt.errors.SourceChangedError` (its version counter is compared when every write is
done), nothing committed. A blocking save's caller is waiting, so only another thread can do it.

:class:`DirectWrites` is a part of :class:`fastckpt.saving.job.SaveJob` (its plan, writers, I/O
pool, hashes and ``first_exc``); the saver chooses it through :meth:`DirectWrites.can_write_direct`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch
import xxhash

from ..device import AllOf, to_host
from ..errors import SourceChangedError

#: Tensors from this size on are written from their own memory; smaller ones through the thread's buffer.
DIRECT_MIN_BYTES = 64 << 10
#: Bytes hashed then written per step: fits the CPU's L2 cache, so the write reads what the hash just read.
PIECE_BYTES = 1 << 20


def _plain(t: torch.Tensor) -> bool:
    """True when ``t``'s memory holds exactly the bytes a save writes for it (a dense, contiguous CPU
    tensor without lazy conjugate / negative bits)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_quantized)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a :func:`_plain` tensor, read in place (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class DirectWrites:
    """The direct-write half of :class:`~fastckpt.saving.job.SaveJob` (see the module docstring)."""

    def can_write_direct(self, sources: dict) -> bool:
        """True when this job may write ``sources`` directly: it writes every unit (one process), no
        copy is deferred, ``o_direct`` is not ``True``, every tensor it writes is on the CPU and every one of at least
        :data:`DIRECT_MIN_BYTES` is :func:`_plain` (others: device, strided or lazily conjugated
        tensors go through staging, as in :meth:`SaveJob.stage`)."""
        if (not self.all_units or self.cons.defer is not None or self.cons.defer_frozen
                or self.io.o_direct is True):  # O_DIRECT asked for: from page-aligned staging memory
            return False
        for f in self.plan.files:
            for t in f.tensors:
                src = sources[t.spec.key]
                if src.device.type != "cpu" or (t.spec.nbytes >= DIRECT_MIN_BYTES and not _plain(src)):
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
                tasks.append([t])
                continue
            if run and (t.file != run[0].file or t.file_offset != end or run_bytes + n > self.plan.chunk_bytes):
                tasks.append(run)
                run, run_bytes = [], 0
            run.append(t)
            run_bytes += n
            end = t.file_offset + n
        if run:
            tasks.append(run)
        self.direct_futs: list[Future] = [self.exec.submit(self._write_task, self.writers[where[task[0].file]], task)
                                          for task in tasks]

    def _write_task(self, w: Any, task: list) -> None:
        """Hash and write one tensor from its memory, or a run of small ones through the thread's buffer."""
        if self.first_exc is not None:
            raise self.first_exc  # a write already failed: do not keep writing
        try:
            if len(task) == 1 and task[0].spec.nbytes >= DIRECT_MIN_BYTES:
                t = task[0]
                data = _bytes(self.direct_sources[t.spec.key])
                h = xxhash.xxh3_64()
                for off in range(0, len(data), PIECE_BYTES):
                    piece = data[off:off + PIECE_BYTES]
                    h.update(piece)  # then written while still in the cache
                    w.write(piece, t.file_offset + off)
                self.hashes[t.spec.key] = h.hexdigest()
                n = len(data)
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
                w.write(view[:n], task[0].file_offset)
            with self.direct_lock:
                self.direct_bytes += n
        except BaseException as e:
            with self.exc_lock:
                if self.first_exc is None:
                    self.first_exc = e
            raise

    def _bounce(self, n: int) -> torch.Tensor:
        """This I/O thread's buffer of at least ``n`` bytes (kept for the job's next runs)."""
        b = getattr(self.bounce, "buf", None)
        if b is None or b.numel() < n:
            b = self.bounce.buf = torch.empty(max(n, 1 << 20), dtype=torch.uint8)
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
                raise SourceChangedError(
                    f"{k!r} was written in place (version counter {was} -> {now}) while fastckpt.save wrote "
                    f"it from its own memory into {self.tmp}: the bytes written may mix old and new values; "
                    "nothing was committed. Do not change the state from another thread during save")
        self.staged.set()
