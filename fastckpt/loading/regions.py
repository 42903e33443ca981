"""Which bytes of which files hold a rectangular region of a stored tensor (pure, no I/O).

A region (a "box") is ``(offsets, shape)`` in element indexes of a tensor's global index space.
A stored tensor (:class:`Stored`) is a C-order run of elements in a file; it may hold the whole
tensor (offsets all zero: a plain or format-v2 full-tensor entry, an HF tensor) or one piece of it
at the piece's global offsets.

:func:`box_runs` turns "this box of that stored tensor goes to this box of a C-order destination"
into ``(file offset, destination byte offset, nbytes)`` runs: a split along dim 0 (``Shard(0)``) is
one run, a split along dim 1 (``Shard(1)``) one run per row, adjacent runs coalesced. The loaders
(:mod:`fastckpt.loading.into`, :mod:`fastckpt.loading.dcp_reader`) read exactly those bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..format.manifest import Box  # noqa: F401  (offsets, shape): the manifest's element box


@dataclass(frozen=True)
class Stored:
    """One stored C-order tensor (or piece) in a file.

    Attributes:
        key: manifest key path or tensor name (for messages).
        file: absolute path of the file.
        abs_offset: byte offset of its first element in the file.
        shape: its shape (elements).
        dtype: safetensors dtype string (``"F32"``...).
        itemsize: bytes per element.
        origin: global index of its first element (all zeros for a full tensor).
    """

    key: str
    file: str
    abs_offset: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    origin: tuple[int, ...]

    @property
    def box(self) -> Box:
        """The global box this stored tensor covers."""
        return self.origin, self.shape


@dataclass(frozen=True)
class ByteRun:
    """Read ``nbytes`` at ``file_offset`` of ``file`` into destination bytes ``[dst_offset, +nbytes)``."""

    file: str
    file_offset: int
    dst_offset: int
    nbytes: int


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they do not overlap (a 0-dim box
    overlaps itself). Empty boxes (a zero in the shape) never overlap anything."""
    (ao, ash), (bo, bsh) = a, b
    if math.prod(ash) == 0 or math.prod(bsh) == 0:
        return None
    off, shape = [], []
    for x, n, y, m in zip(ao, ash, bo, bsh):
        lo, hi = max(x, y), min(x + n, y + m)
        if lo >= hi:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def contains(outer: Box, inner: Box) -> bool:
    """True when box ``inner`` lies inside box ``outer``."""
    return all(o <= i and i + m <= o + n for o, n, i, m in zip(outer[0], outer[1], inner[0], inner[1]))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def box_runs(src: Stored, box: Box, dst: Box) -> list[ByteRun]:
    """Byte runs that copy global ``box`` from ``src`` into a C-order destination covering global ``dst``.

    Args:
        src: the stored tensor; ``box`` must lie inside ``src.box``.
        box: global ``(offsets, shape)`` to copy.
        dst: global ``(offsets, shape)`` of the destination (a contiguous buffer of that shape with
            the same itemsize); ``box`` must lie inside it.

    Returns:
        Runs sorted by destination offset, adjacent runs (in the file and the destination) merged.

    Raises:
        ValueError: ``box`` is not inside ``src.box`` or ``dst`` (a planning bug, never user input).
    """
    if not (contains(src.box, box) and contains(dst, box)):
        raise ValueError(f"box {box} is not inside stored {src.box} of {src.key!r} and destination {dst}")
    isz = src.itemsize
    off, shape = box
    nd = len(shape)
    if nd == 0:
        return [ByteRun(src.file, src.abs_offset, 0, isz)]
    if math.prod(shape) == 0:
        return []
    ss, ds = _strides(src.shape), _strides(dst[1])
    # j: the outermost dim of the contiguous inner block (every dim after it is whole in src and dst)
    j = nd - 1
    while j > 0 and shape[j] == src.shape[j] == dst[1][j]:
        j -= 1
    block = math.prod(shape[j:]) * isz
    s_rel = [o - so for o, so in zip(off, src.origin)]
    d_rel = [o - do for o, do in zip(off, dst[0])]
    runs: list[ByteRun] = []
    idx = [0] * j
    while True:
        s = sum((s_rel[d] + idx[d]) * ss[d] for d in range(j)) + s_rel[j] * ss[j]
        t = sum((d_rel[d] + idx[d]) * ds[d] for d in range(j)) + d_rel[j] * ds[j]
        fo, do = src.abs_offset + s * isz, t * isz
        last = runs[-1] if runs else None
        if last is not None and last.file_offset + last.nbytes == fo and last.dst_offset + last.nbytes == do:
            runs[-1] = ByteRun(src.file, last.file_offset, last.dst_offset, last.nbytes + block)
        else:
            runs.append(ByteRun(src.file, fo, do, block))
        d = j - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < shape[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return runs


def split_runs(runs: list[ByteRun], max_bytes: int) -> list[ByteRun]:
    """``runs`` with each run longer than ``max_bytes`` cut into pieces of at most ``max_bytes``."""
    out: list[ByteRun] = []
    for r in runs:
        if r.nbytes <= max_bytes:
            out.append(r)
            continue
        for a in range(0, r.nbytes, max_bytes):
            out.append(ByteRun(r.file, r.file_offset + a, r.dst_offset + a, min(max_bytes, r.nbytes - a)))
    return out


def dim0_blocks(box: Box, row_bytes_cap: int, itemsize: int) -> list[Box]:
    """Cut ``box`` along dim 0 into boxes of at most ``row_bytes_cap`` bytes (at least one dim-0
    index each; a 0-dim box is returned as is)."""
    off, shape = box
    if not shape:
        return [box]
    row = math.prod(shape[1:]) * itemsize
    per = max(1, row_bytes_cap // max(row, 1))
    return [((off[0] + a,) + off[1:], (min(per, shape[0] - a),) + shape[1:]) for a in range(0, shape[0], per)]
