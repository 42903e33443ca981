"""Format-v2 per-chunk checksums: check tensors against the ``"chunks"`` of their manifest entry.

A tensor written in pieces by several ranks (a DTensor save) has, instead of one ``"xxh3"``, a list
``"chunks": [{"offsets": [...], "shape": [...], "xxh3": "..."}]`` that tiles the tensor exactly;
each ``xxh3`` is the xxh3-64 of the chunk's elements in row-major order (``full[region].contiguous()``
bytes). See docs/FORMAT.md ("Version 2: per-chunk checksums"); :func:`fastckpt.format.manifest.parse`
validates the chunks (they tile the tensor).
"""

from __future__ import annotations

import torch
import xxhash

from ..errors import ChecksumMismatchError
from ..format.manifest import TensorEntry
from .regions import Box


def box_bytes(t: torch.Tensor, box: Box, origin: tuple[int, ...] = ()) -> memoryview:
    """Row-major bytes of ``t[box]`` (``t`` covering the global box starting at ``origin``), on the CPU."""
    origin = origin or (0,) * t.dim()
    sl = tuple(slice(o - b, o - b + n) for o, n, b in zip(box[0], box[1], origin))
    part = t[sl].detach().contiguous().cpu() if sl else t.detach().reshape(()).cpu()
    if part.numel() == 0:
        return memoryview(b"")
    return memoryview(part.reshape(-1).view(torch.uint8).numpy())


def chunk_problem(key: str, file: str, box: Box, want: str, data: memoryview) -> str | None:
    """``None`` when ``data`` hashes to ``want``, else the message naming file, key and chunk."""
    got = xxhash.xxh3_64(data).hexdigest()
    if got == want:
        return None
    return (f"{file}: tensor {key!r} chunk at offsets {list(box[0])} of shape {list(box[1])} has xxh3 {got}, "
            f"manifest says {want}")


def check_chunks(t: torch.Tensor, key: str, entry: TensorEntry, file: str) -> None:
    """Check the whole tensor ``t`` (any device) against every chunk checksum of ``entry``.

    Raises:
        ChecksumMismatchError: a chunk's bytes differ (names file, key, chunk offsets and shape).
    """
    for c in entry.chunks or ():
        problem = chunk_problem(key, file, c.box, c.xxh3, box_bytes(t, c.box))
        if problem:
            raise ChecksumMismatchError(problem, path=file, tensor=key)
