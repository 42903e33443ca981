"""The plan of a device load (pure, no I/O): which byte ranges of which files are read, cut into
pieces of at most one ring slot, and the copies that move each piece's bytes into the destination
tensors (adjacent small tensors share a piece; a tensor-parallel slice reads only its own byte
ranges, see :mod:`fastckpt.loading.tp`). :mod:`fastckpt.loading.device` executes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.dtypes import itemsize, str_to_dtype
from ..format.safetensors import TensorInfo
from .tp import SliceSpec

#: A per-row segment at least this large is read alone (only needed bytes); smaller ones read whole rows.
SEGMENT_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class Target:
    """One destination tensor: where its bytes are in the file and which of them are wanted."""

    key: str
    file: str
    abs_offset: int
    info: TensorInfo
    slice: SliceSpec | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the destination (the slice, or the whole tensor)."""
        return self.slice.nbytes if self.slice else self.info.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the destination."""
        return self.slice.shape if self.slice else tuple(self.info.shape)


@dataclass(frozen=True)
class Copy:
    """Move bytes from a slot into target ``dest``.

    Flat (``rows == 0``): slot ``[src_off, src_off + nbytes)`` -> dest ``[dst_off, ...)``.
    Rows: ``rows`` stored rows of ``row_bytes`` starting at ``src_off`` in the slot; bytes
    ``[col_off, col_off + col_bytes)`` of each go to dest rows ``dst_off // col_bytes`` onward.
    """

    dest: int
    dst_off: int
    src_off: int
    nbytes: int
    rows: int = 0
    row_bytes: int = 0
    col_off: int = 0
    col_bytes: int = 0


@dataclass(frozen=True)
class Piece:
    """One read: ``nbytes`` at ``offset`` of ``file`` into a slot, then ``copies``."""

    file: str
    offset: int
    nbytes: int
    copies: tuple[Copy, ...]


def flat_ranges(t: Target) -> list[tuple[int, int, int]]:
    """``(file offset, dest offset, nbytes)`` ranges of a target read as flat copies, or [] for row reads."""
    s = t.slice
    if s is None:
        return [(t.abs_offset, 0, t.info.nbytes)]
    if s.contiguous:
        return [(t.abs_offset + s.col_off, 0, s.nbytes)]
    return []


def _step(t: Target, slot_bytes: int) -> int:
    """Largest multiple of ``t``'s element size that fits a slot: a split never cuts an element."""
    isz = itemsize(str_to_dtype(t.info.dtype, tensor=t.key, path=t.file))
    if slot_bytes < isz:
        raise ValueError(f"slot_bytes={slot_bytes} is smaller than one element ({isz} bytes) of tensor {t.key!r}")
    return slot_bytes - slot_bytes % isz


def plan_pieces(targets: list[Target], slot_bytes: int, skip: frozenset[int] = frozenset()) -> list[Piece]:
    """Split the reads of ``targets`` into pieces of at most ``slot_bytes`` (pure, deterministic).

    Copies name their target by index in ``targets``; indexes in ``skip`` are not read. A tensor
    split across pieces is cut at multiples of its element size, so every copy holds whole
    elements (a dtype conversion can run per copy).

    Raises:
        ValueError: ``slot_bytes`` is not positive, or smaller than one element of a split tensor.
    """
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
    pieces: list[Piece] = []
    run: list[tuple[int, int, int, int]] = []  # (dest, file offset, dest offset, n), adjacent in the file
    run_file = ""

    def flush() -> None:
        if run:
            start = run[0][1]
            pieces.append(Piece(run_file, start, run[-1][1] + run[-1][3] - start,
                                tuple(Copy(d, do, fo - start, n) for d, fo, do, n in run)))
            run.clear()

    order = sorted(range(len(targets)), key=lambda i: (targets[i].file, targets[i].abs_offset))
    for i in order:
        t = targets[i]
        if t.nbytes == 0 or i in skip:
            continue
        flat = flat_ranges(t)
        if not flat:
            flush()
            pieces.extend(_row_pieces(i, t, slot_bytes))
            continue
        for fo, do, n in flat:
            if n > slot_bytes // 4:
                flush()
                step = _step(t, slot_bytes)
                for a in range(0, n, step):
                    m = min(step, n - a)
                    pieces.append(Piece(t.file, fo + a, m, (Copy(i, do + a, 0, m),)))
                continue
            if run and (run_file != t.file or run[-1][1] + run[-1][3] != fo
                        or fo + n - run[0][1] > slot_bytes):
                flush()
            run_file = t.file
            run.append((i, fo, do, n))
    flush()
    return pieces


def _row_pieces(i: int, t: Target, slot_bytes: int) -> list[Piece]:
    """Pieces of a non-contiguous slice: per-row segments when large, else blocks of whole rows."""
    s = t.slice
    assert s is not None
    out: list[Piece] = []
    if s.col_bytes >= SEGMENT_MIN_BYTES or s.row_bytes > slot_bytes:
        step = _step(t, slot_bytes)
        for r in range(s.outer):
            fo, do = t.abs_offset + r * s.row_bytes + s.col_off, r * s.col_bytes
            for a in range(0, s.col_bytes, step):
                m = min(step, s.col_bytes - a)
                out.append(Piece(t.file, fo + a, m, (Copy(i, do + a, 0, m),)))
        return out
    per = max(1, slot_bytes // s.row_bytes)
    for r0 in range(0, s.outer, per):
        k = min(per, s.outer - r0)
        out.append(Piece(t.file, t.abs_offset + r0 * s.row_bytes, k * s.row_bytes,
                         (Copy(i, r0 * s.col_bytes, 0, k * s.col_bytes, k, s.row_bytes, s.col_off, s.col_bytes),)))
    return out


# ---------------------------------------------------------------------------------------------
# Engines: how bytes get from a host slot into device memory
# ---------------------------------------------------------------------------------------------
