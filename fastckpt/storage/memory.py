"""Host memory for staging and loading: page-aligned ``mmap`` buffers, optionally huge pages.

Buffers are ``mmap`` objects, so they are page aligned (O_DIRECT-safe), and the torch
tensors built on them keep the mapping alive (``torch.frombuffer`` holds a reference), so a
tensor handed out always owns its memory. Transparent huge pages are opt-in
(:data:`USE_THP`): they fault faster on bare metal but much slower on ballooned VMs.
"""

from __future__ import annotations

import mmap
import os

import torch

#: Buffers at least this large (bytes) get their own mapping (huge pages when :data:`USE_THP`).
HUGE_MIN_BYTES = 1 << 21
#: Ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``). Off by default: on VMs whose
#: balloon reports free memory to the host (virtio free page reporting works on 2 MiB blocks),
#: every fresh huge page faults back in from the host, and we measured huge-page first touch
#: 4-9x *slower* than 4 KiB pages (0.2-0.5 vs 1.5-2 GB/s) on the reference VM. Set
#: ``FASTCKPT_THP=1`` where huge pages fault faster (bare metal).
USE_THP = os.environ.get("FASTCKPT_THP", "0").lower() in ("1", "true", "yes")
PAGE = mmap.PAGESIZE


def host_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """Allocate ``nbytes`` of page-aligned host memory.

    Args:
        nbytes: size in bytes (may be 0).

    Returns:
        ``(tensor, view)``: a 1-D ``torch.uint8`` CPU tensor of ``nbytes`` elements and a
        writable ``memoryview`` of the same memory (for ``os.preadv``/``os.pwrite``).
        Only allocations of at least ``HUGE_MIN_BYTES`` are page aligned (mmap backed);
        smaller ones come from the torch allocator (64-byte aligned).
        Allocations of at least ``HUGE_MIN_BYTES`` are backed by transparent huge pages
        where the kernel allows it.
    """
    if nbytes < HUGE_MIN_BYTES:
        t = torch.empty(nbytes, dtype=torch.uint8)
        return t, memoryview(t.numpy()) if nbytes else memoryview(bytearray(0))
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if USE_THP and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    t = torch.frombuffer(m, dtype=torch.uint8)
    return t, memoryview(m)


def aligned_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """Like :func:`host_buffer` but always ``mmap`` backed, so page aligned at any size (O_DIRECT).

    ``nbytes`` must be > 0; sizes of at least ``HUGE_MIN_BYTES`` get transparent huge pages.
    """
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if USE_THP and nbytes >= HUGE_MIN_BYTES and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(m, dtype=torch.uint8), memoryview(m)


def pinned_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview] | None:
    """``nbytes`` (> 0) of page-locked host memory, or ``None`` where no CUDA device is present.

    Allocated page-locked at once (``torch.empty(..., pin_memory=True)``, torch's pinned host
    allocator, page aligned), not faulted in as ordinary pages first and then copied by
    ``Tensor.pin_memory()``. Page-locking costs time (about 0.3-1 s per GiB, done once per buffer)
    and gains only device <-> host copies, so only buffers that such copies use ask for it: a state
    of CPU tensors is staged into ordinary pages even on a CUDA machine.

    Returns:
        ``(tensor, view)``: a 1-D ``torch.uint8`` pinned CPU tensor of ``nbytes`` elements and a
        writable ``memoryview`` of it; ``None`` without CUDA, or where pinning fails (e.g. the
        locked-memory limit), so the caller falls back to :func:`host_buffer`.
    """
    if not torch.cuda.is_available():
        return None
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return None
    return t, memoryview(t.numpy())


def needs_pinned(tensors) -> bool:
    """True when any of ``tensors`` (an iterable of values; non-tensors ignored) is on a CUDA device,
    the one case where a page-locked staging buffer speeds the copies up."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """1-D ``torch.uint8`` view of a contiguous tensor's bytes (no copy); ``t`` must be contiguous."""
    return t.reshape(-1).view(torch.uint8)
