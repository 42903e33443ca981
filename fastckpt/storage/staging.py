"""Staging: device/host tensors -> one reusable host buffer laid out like the save stream.

The pool keeps its buffer between saves (page-locked when a save stages CUDA tensors, ordinary
pages otherwise), so a repeated save copies into memory that is already faulted in.
When the budget (``staging_bytes``) is smaller than the state, the buffer is a ring of
``chunk_bytes`` slots: the copier waits only for the oldest slot's write to finish.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..device import to_host
from .memory import HUGE_MIN_BYTES, host_buffer, pinned_buffer


class StagingPool:
    """A reusable host buffer; one save holds it at a time.

    Call order: ``acquire(nbytes)`` (by the saving thread) -> copies -> ``release()``
    (by the background writer when every byte is written).
    """

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._pinned = False
        self._busy = threading.Lock()

    @property
    def capacity(self) -> int:
        """Bytes currently allocated."""
        return 0 if self._tensor is None else self._tensor.numel()

    def acquire(self, nbytes: int, pinned: bool = False) -> tuple[torch.Tensor, memoryview]:
        """Block until the pool is free, then return ``(uint8 tensor, memoryview)`` of >= ``nbytes``.

        Args:
            nbytes: bytes the save stages.
            pinned: the save stages CUDA tensors (see :func:`~fastckpt.storage.memory.needs_pinned`):
                the buffer is page-locked (:func:`~fastckpt.storage.memory.pinned_buffer`; a buffer
                of ordinary pages is replaced). ``False`` (default) takes whatever buffer the pool
                holds, page-locked or not: a CPU state never pays for page-locking.
        """
        self._busy.acquire()
        try:
            if self._tensor is None or self.capacity < nbytes or (pinned and not self._pinned):
                self._tensor = self._view = None
                # at least HUGE_MIN_BYTES: host_buffer is page aligned (mmap) only from that size,
                # and O_DIRECT writes need page-aligned memory
                n = max(nbytes, HUGE_MIN_BYTES)
                buf = pinned_buffer(n) if pinned else None
                self._pinned = buf is not None
                self._tensor, self._view = buf if buf is not None else host_buffer(n)
            return self._tensor, self._view
        except BaseException:
            self._busy.release()
            raise

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate (if needed) and fault in at least ``nbytes`` now, so the first save copies
        into touched memory (fresh pages fault in at ~0.3-1.3 GB/s on small VMs); ``pinned`` as
        in :meth:`acquire` (page-locked memory is faulted in when it is allocated)."""
        t, _ = self.acquire(nbytes, pinned)
        try:
            page = 4096
            t[::page].zero_()  # one write per page faults every page in
        finally:
            self.release()

    def release(self) -> None:
        """Hand the buffer back for the next save."""
        self._busy.release()

    def free(self) -> None:
        """Drop the buffer (memory is returned once no save holds it)."""
        with self._busy:
            self._tensor = self._view = None


def copy_pieces(src: torch.Tensor, start: int, chunk: int, slot_of: Callable[[int], torch.Tensor],
                hasher=None) -> None:
    """Copy ``src``'s bytes to stream position ``start`` piece by piece across ring slots.

    Each piece is copied through :func:`fastckpt.device.to_host` and its completion (a CUDA/NPU
    event after the copy; at once on CPU) is waited for before the piece is hashed and before the
    next ``slot_of`` call (which may submit the writes of everything staged before it): when this
    returns, every byte of ``src`` is in its slots.

    Args:
        src: tensor to copy (any device; made contiguous first if it is not).
        start: stream byte offset of the tensor.
        chunk: slot size in bytes.
        slot_of: grid index -> the slot's ``uint8`` host tensor (waits until the slot is free).
        hasher: optional object with ``update(buffer)``, fed the staged bytes in order.
    """
    flat = src.reshape(-1).contiguous().view(torch.uint8) if src.numel() else None
    n = 0 if flat is None else flat.numel()
    a = 0
    while a < n:
        pos = start + a
        off = pos % chunk
        m = min(n - a, chunk - off)
        piece = slot_of(pos // chunk)[off:off + m]
        to_host(piece, flat[a:a + m]).wait()
        if hasher is not None:
            hasher.update(piece.numpy())
        a += m


#: Bytes of one batched staging copy (small enough for writes to start while the caller copies).
_RUN_BYTES = 64 << 20
#: Tensors below this size are staged in batches (their per-tensor overhead exceeds the copy).
_SMALL_BYTES = 1 << 20


def copy_runs(tensors: list, sources: dict) -> list[list]:
    """Split planned tensors (:class:`fastckpt.format.layout.PlannedTensor`, stream order) into runs
    that one ``torch.cat`` can stage: small
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
