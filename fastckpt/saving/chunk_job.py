"""One rank's writes of a DTensor save: stage its chunks into its pages, hand edge bytes over, write, hash.

Runs inside :meth:`fastckpt.saving.dcp_writer.FastCkptWriter.write_data` on every rank, from
the :class:`~fastckpt.saving.chunks.RankLayout` of the rank (pure). Call order:

1. ``stage``: acquire the staging buffer (the engine's :class:`~fastckpt.storage.staging.StagingPool`),
   publish the head bytes that belong to other ranks' pages (``edge/{src}/{dst}`` in the save's store
   session; a failed rank publishes a failure marker instead, so nobody waits for it);
2. ``write``: take the edge bytes of the other ranks, then copy the rank's own bytes into its pages
   (``Shard(0)``: one range; ``Shard(1)``: a range per row) in buffer order while the pool threads
   ``pwrite`` each page span as soon as its bytes are there, with the engine's
   :class:`~fastckpt.storage.io.FileWriter` (O_DIRECT where asked: spans are page aligned in the
   file and in memory), ``fsync``;
3. ``hashes``: xxh3-64 of each chunk's elements in row-major order (the bytes of
   ``full[region].contiguous()``: the manifest's per-chunk checksum).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from ..coordination import Session
from ..format.layout import SavePlan
from ..storage.io import FileWriter, default_threads, get_backend, group_by_bytes
from ..storage.staging import StagingPool
from .chunks import Chunk, RankLayout, layout
from .options import SaveOptions

_OK, _FAILED = b"\x00", b"\x01"


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order as a flat ``uint8`` CPU tensor (a view when possible)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.reshape(-1).view(torch.uint8)


class ChunkJob:
    """One rank's part of one DTensor save (see the module docstring).

    Args:
        plan: the full-tensor plan (the same on every rank).
        chunks: every chunk of the save and the rank writing it (the same on every rank).
        rank: this rank; ``folder``: the temporary folder holding the files (created by rank 0).
        opts: the save's options (``o_direct``, ``io_backend``, ``threads``, ``chunk_bytes``).
        pool: staging memory; ``sess``: the save's store session (edge bytes).
    """

    def __init__(self, plan: SavePlan, chunks: list[Chunk], rank: int, folder: str, opts: SaveOptions,
                 pool: StagingPool, sess: Session):
        self.plan, self.chunks, self.rank, self.folder = plan, chunks, rank, folder
        self.opts, self.pool, self.sess = opts, pool, sess
        self.lay: RankLayout = _layout(plan, chunks, rank)
        self.src: dict[int, torch.Tensor] = {}
        self.buf: torch.Tensor | None = None
        self.held = False
        self.sent: set[int] = set()
        self.bytes_written = 0
        self._hashes: dict[int, str] | None = None

    def stage(self, sources: dict[str, torch.Tensor]) -> None:
        """Copy this rank's chunks (``sources``: key path -> its local tensor) into its pages; send edges."""
        lay = self.lay
        for ci in lay.chunks:
            c = self.chunks[ci]
            t = sources[c.key]
            if tuple(t.shape) != c.shape:
                raise ValueError(f"local tensor of {c.key!r} has shape {list(t.shape)}, its chunk {list(c.shape)}")
            self.src[ci] = host_bytes(t)
        self.buf, _ = self.pool.acquire(lay.buffer_bytes)
        self.held = True
        for dst, items in lay.sends.items():  # first: other ranks wait for these
            blob = torch.cat([self.src[ci][s:s + n] for ci, s, n in items]) if items else torch.empty(0, dtype=torch.uint8)
            self.sess.publish_bytes(f"edge/{self.rank}/{dst}", _OK + blob.numpy().tobytes())
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
        """Take the other ranks' edge bytes, copy this rank's own bytes into its pages while the
        pages already complete are written (about ``chunk_bytes`` per task, in buffer order), fsync."""
        lay, buf = self.lay, self.buf
        for src, items in sorted(lay.recvs.items()):
            data = self.sess.wait_bytes(f"edge/{src}/{self.rank}", f"waiting for rank {src}'s edge bytes")
            if data[:1] != _OK:
                raise RuntimeError(f"rank {src} failed before handing over its edge bytes: {data[1:].decode()}")
            got = torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8) if len(data) > 1 else None
            pos = 0
            for off, n in items:
                buf[off:off + n].copy_(got[pos:pos + n])
                pos += n
        be = get_backend(self.opts.io.io_backend)
        step = self.opts.io.chunk_bytes
        writers: dict[int, FileWriter] = {}
        view = memoryview(buf.numpy()) if lay.buffer_bytes else None
        try:
            for fi in sorted({fi for fi, _, _, _ in lay.spans}):
                writers[fi] = FileWriter(be, os.path.join(self.folder, self.plan.files[fi].name),
                                         self.plan.files[fi].size, self.opts.io.o_direct is not False, create=False)
            pieces = [(fi, a + d, off + d, min(step, b - a - d)) for fi, a, b, off in lay.spans
                      for d in range(0, b - a, step)]
            tasks = group_by_bytes(pieces, step)  # about chunk_bytes per task: a Shard(1) chunk is thousands of row spans
            # (last buffer byte + 1, task), in that order
            tasks = sorted(((max(o + n for _, _, o, n in t), t) for t in tasks if t), key=lambda e: e[0])
            # own bytes in buffer order, cut at chunk_bytes: a task is written once every copy that starts
            # before its last buffer byte is done (copies run in this thread, writes in the pool)
            copies = sorted((off + d, ci, s + d, min(step, n - d)) for ci, s, n, off in lay.copies
                            for d in range(0, n, step))

            def run(task: list) -> None:
                for fi, x, o, n in task:
                    writers[fi].write(view[o:o + n], x)
            with ThreadPoolExecutor(self.opts.io.threads or default_threads(),
                                    thread_name_prefix="fastckpt-io") as ex:
                futs, i = [], 0
                for end, t in tasks:  # copies past the last span's end would never be written: there are none
                    while i < len(copies) and copies[i][0] < end:
                        off, ci, s, n = copies[i]
                        buf[off:off + n].copy_(self.src[ci][s:s + n])
                        i += 1
                    futs.append(ex.submit(run, t))
                self.hashes()  # while the last writes are in flight
                for f in futs:
                    f.result()
                for f in [ex.submit(w.sync) for w in writers.values()]:
                    f.result()
            self.bytes_written = lay.written_bytes
        finally:
            for w in writers.values():
                w.close()

    def hashes(self) -> dict[int, str]:
        """xxh3-64 hex digest of each of this rank's chunks (chunk index -> digest; computed once)."""
        if self._hashes is None:
            self._hashes = {ci: xxhash.xxh3_64(self.src[ci].numpy()).hexdigest() for ci in self.lay.chunks}
        return self._hashes

    def release(self) -> None:
        """Hand the staging buffer back (once); drop the source views."""
        self.buf = None
        self.src = {}
        if self.held:
            self.held = False
            self.pool.release()


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
    lay = layout(plan, chunks, rank)
    with _MEMO_LOCK:
        _MEMO[0], _MEMO[1] = key, lay
    return lay


def run_job(job: ChunkJob, sources: dict[str, Any]) -> dict[int, str]:
    """``stage`` -> ``write`` -> ``hashes`` of ``job``; on failure tell the waiting ranks, release, re-raise."""
    try:
        job.stage(sources)
        job.write()
        return job.hashes()
    except BaseException as e:
        job.fail_edges(e)
        raise
    finally:
        job.release()
