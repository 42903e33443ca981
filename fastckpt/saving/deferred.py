"""Deferred staging copies (``defer`` / ``defer_frozen``): the pipelined snapshot.

Tensors the caller lets the save copy later are staged by the background thread, in stream
order, before their write units go out; each unit is submitted once every byte of it is staged,
and :attr:`SaveJob.staged` is set when no source is needed any more (CheckFreq's pipelined
snapshot, Mohan et al., FAST 2021). Version counters (and, for ``defer_frozen``, recorded
hashes) detect writes the caller made too early.

:class:`DeferredStaging` is a part of :class:`fastckpt.saving.job.SaveJob`: it uses the job's
plan, units, staging view, I/O pool and ``_write_unit``.
"""

from __future__ import annotations

import bisect

import torch
import xxhash

from ..device import to_host
from ..errors import LinkedTensorChangedError, SourceChangedError
from ..storage.staging import copy_runs
from . import dedupe


#: Deferred tensors from this size on are copied and hashed piece by piece (:meth:`SaveJob._copy_and_hash`;
#: smaller ones are batched by ``torch.cat`` and hashed on the pool).
_FUSED_BYTES = 1 << 20
#: Piece of :meth:`SaveJob._copy_and_hash`: hashed right after its copy, from the CPU cache; few
#: pieces per tensor, since each takes the GIL (a Python-bound main thread holds it up to 5 ms).
_FUSED_PIECE = 4 << 20


class DeferredStaging:
    """The deferred-copy half of :class:`~fastckpt.saving.job.SaveJob` (see the module docstring)."""

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
        for run in copy_runs(tensors, self.sources):
            self._check_versions(run)
            if len(run) == 1 and run[0].spec.nbytes >= _FUSED_BYTES and self.sources[run[0].spec.key].is_contiguous():
                b = self._copy_and_hash(run[0])
            else:
                b, done = self._copy_run(run, self.sources)
                done.wait()  # the run's bytes are there before its units are written or hashed
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
        Each piece's copy goes through :func:`fastckpt.device.to_host` and is waited for before the
        piece is hashed.
        One thread (NumPy's copy, GIL released): this runs while training computes, and torch's
        multi-threaded copy takes more from it. Measured on 2 cores, 327 MB staged every 0.3 s
        while the main thread ran 60 MLP forward/backward passes (0.37 s alone): 0.56-0.58 s with
        NumPy pieces of 512 KiB or 4 MiB, 0.68 s with torch pieces, 0.67 s with a torch copy then
        pooled hashing."""
        src = self.sources[t.spec.key].reshape(-1).view(torch.uint8)
        h = xxhash.xxh3_64()
        a, n = self._at(t.stream_offset), t.spec.nbytes
        for off in range(0, n, _FUSED_PIECE):
            m = min(_FUSED_PIECE, n - off)
            to_host(self.buf[a + off:a + off + m], src[off:off + m], one_thread=True).wait()
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
