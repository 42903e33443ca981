"""Format-v2 per-chunk checksums: validate ``"chunks"`` manifest entries and check tensors against them.

A tensor written in pieces by several ranks (a DTensor save) has, instead of one ``"xxh3"``, a list
``"chunks": [{"offsets": [...], "shape": [...], "xxh3": "..."}]`` that tiles the tensor exactly;
each ``xxh3`` is the xxh3-64 of the chunk's elements in row-major order (``full[region].contiguous()``
bytes). See docs/FORMAT.md ("Version 2: per-chunk checksums").
"""

from __future__ import annotations

import math

import torch
import xxhash

from ..errors import ChecksumMismatchError, CorruptCheckpointError
from .regions import Box, intersect


def chunk_boxes(key: str, entry: dict, where: str) -> list[tuple[Box, str]]:
    """The ``((offsets, shape), xxh3)`` of each chunk of manifest entry ``entry`` ([] without chunks).

    Raises:
        CorruptCheckpointError: a malformed chunk, one outside the tensor, overlapping chunks or
            chunks that do not cover it (names the manifest ``where``, the key and the chunk).
    """
    chunks = entry.get("chunks")
    if chunks is None:
        return []
    shape = entry.get("shape")
    out: list[tuple[Box, str]] = []
    bad = None
    if not isinstance(chunks, list) or not isinstance(shape, list):
        bad = "'chunks' is not a list"
    else:
        for c in chunks:
            ok = isinstance(c, dict) and isinstance(c.get("xxh3"), str) and all(
                isinstance(c.get(f), list) and len(c[f]) == len(shape)
                and all(isinstance(x, int) and x >= 0 for x in c[f]) for f in ("offsets", "shape"))
            if not ok or any(o + n > m for o, n, m in zip(c["offsets"], c["shape"], shape)):
                bad = f"chunk {c!r} is malformed or lies outside shape {shape}"
                break
            out.append(((tuple(c["offsets"]), tuple(c["shape"])), c["xxh3"]))
    if bad is None:
        total = sum(math.prod(b[1]) for b, _ in out)
        if total != math.prod(shape):
            bad = f"chunks cover {total} elements, the tensor of shape {shape} has {math.prod(shape)}"
        else:
            for i, (a, _) in enumerate(out):
                for b, _ in out[i + 1:]:
                    if intersect(a, b) is not None:
                        bad = f"chunks at offsets {list(a[0])} and {list(b[0])} overlap"
                        break
                if bad:
                    break
    if bad:
        raise CorruptCheckpointError(f"{where}: tensor {key!r}: {bad}; the manifest is damaged "
                                     "(run `fastckpt verify`)", path=where, tensor=key)
    return out


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


def check_chunks(t: torch.Tensor, key: str, entry: dict, file: str) -> None:
    """Check the whole tensor ``t`` (any device) against every chunk checksum of ``entry``.

    Raises:
        ChecksumMismatchError: a chunk's bytes differ (names file, key, chunk offsets and shape).
        CorruptCheckpointError: malformed chunks (see :func:`chunk_boxes`).
    """
    for box, want in chunk_boxes(key, entry, file):
        problem = chunk_problem(key, file, box, want, box_bytes(t, box))
        if problem:
            raise ChecksumMismatchError(problem, path=file, tensor=key)
