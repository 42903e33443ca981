"""Where the chunks of sharded tensors land in full-tensor files, and who writes each page (pure, no I/O).

A DTensor save writes the same files as a one-process save of the full tensors (the plan of
:func:`fastckpt.format.layout.plan_save`); each rank writes the chunks DCP's planner gave it.
A chunk (``offsets``, ``shape`` in elements, inside a tensor of shape ``S``) covers one or
more *runs*: contiguous byte ranges of the file. A chunk spanning every trailing dim from
some dim ``k`` on (a ``Shard(0)`` piece: ``k = 0``) is one run per index of the dims before
``k`` (one range in all for ``Shard(0)``, one per row for ``Shard(1)`` of a matrix).

Pages (4096 bytes of a file) have exactly one writer, so O_DIRECT writes stay aligned and
network file systems that cache whole pages (NFS, Lustre) never see two clients write one
page: the writer of a page is the rank of the run that holds the page's first byte. The runs
tile the data region (tensors are back to back, chunks tile each tensor), so a run's pages
from its first page boundary on are its own; only its *head*, the bytes before that boundary,
can fall in a page of another rank, which then gets those bytes from the run's rank.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from ..format.dtypes import itemsize, str_to_dtype
from ..format.layout import SavePlan

#: Bytes of one page: the unit of single-writer ownership (O_DIRECT alignment, NFS/Lustre caching).
PAGE = 4096


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor written by one rank.

    Attributes:
        key: key path of the tensor (a spec key of the plan).
        offsets: global element index of the chunk's first element, one int per dim.
        shape: chunk shape (elements per dim).
        rank: the rank that writes it (DCP's global plan).
    """

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int

    @property
    def numel(self) -> int:
        """Elements in the chunk."""
        return math.prod(self.shape)


def chunk_runs(shape: tuple[int, ...], esize: int, start: int, offsets: tuple[int, ...],
               size: tuple[int, ...]) -> list[tuple[int, int]]:
    """Absolute byte ranges ``[a, b)`` of a chunk in a file, in the chunk's row-major order.

    Args:
        shape: the full tensor's shape; ``esize``: bytes per element; ``start``: file offset of
            the tensor's first byte.
        offsets, size: the chunk's box (elements).
    """
    n = len(shape)
    if n == 0:
        return [(start, start + esize)]
    if math.prod(size) == 0:
        return []
    k = n - 1
    while k > 0 and size[k] == shape[k] and offsets[k] == 0:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    run = size[k] * strides[k] * esize
    base = offsets[k] * strides[k]
    out = []
    for idx in itertools.product(*(range(offsets[d], offsets[d] + size[d]) for d in range(k))):
        e = base + sum(i * strides[d] for d, i in enumerate(idx))
        a = start + e * esize
        out.append((a, a + run))
    return out


@dataclass
class RankLayout:
    """What one rank copies, sends, receives and writes (see the module docstring).

    Attributes:
        spans: ``(file index, A, B, buffer offset)``: byte ranges of the pages this rank writes
            (``A`` page aligned, ``B`` page aligned or the file's end), placed page aligned in
            its staging buffer.
        buffer_bytes: size of that buffer.
        copies: ``(chunk index, source byte offset, nbytes, buffer offset)`` of its own bytes
            that land in its own pages.
        sends: destination rank -> ``(chunk index, source byte offset, nbytes)`` of head bytes
            that land in that rank's pages, in the order the destination expects them.
        recvs: source rank -> ``(buffer offset, nbytes)`` of bytes it receives, in blob order.
        chunks: indexes of the chunks this rank writes.
    """

    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    buffer_bytes: int = 0
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)
    sends: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    recvs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    chunks: list[int] = field(default_factory=list)

    @property
    def written_bytes(self) -> int:
        """Bytes of file this rank writes itself."""
        return sum(b - a for _, a, b, _ in self.spans)


def check_tiling(plan: SavePlan, chunks: list[Chunk]) -> None:
    """Raise ``ValueError`` unless the chunks of each planned tensor tile it exactly (element counts
    add up, every box inside the tensor); DCP's planner validates overlaps."""
    specs = {t.spec.key: t.spec for f in plan.files for t in f.tensors}
    count: dict[str, int] = {}
    for c in chunks:
        s = specs.get(c.key)
        if s is None:
            raise ValueError(f"chunk of {c.key!r}: no such tensor in the plan")
        if len(c.offsets) != len(s.shape) or any(o < 0 or o + n > m for o, n, m in zip(c.offsets, c.shape, s.shape)):
            raise ValueError(f"chunk of {c.key!r} at {list(c.offsets)} shape {list(c.shape)} leaves tensor shape "
                             f"{list(s.shape)}")
        count[c.key] = count.get(c.key, 0) + c.numel
    for k, s in specs.items():
        if count.get(k, 0) != math.prod(s.shape):
            raise ValueError(f"chunks of {k!r} cover {count.get(k, 0)} of {math.prod(s.shape)} elements")


def layout(plan: SavePlan, chunks: list[Chunk], rank: int) -> RankLayout:
    """The :class:`RankLayout` of ``rank`` (every rank computes its own alike from the same inputs)."""
    where = {t.spec.key: (fi, t) for fi, f in enumerate(plan.files) for t in f.tensors}
    by_file: dict[int, list[tuple[int, int, int, int, int]]] = {}  # fi -> (a, b, rank, chunk index, src offset)
    for ci, c in enumerate(chunks):
        fi, t = where[c.key]
        es = itemsize(str_to_dtype(t.spec.dtype, tensor=c.key))
        src = 0
        for a, b in chunk_runs(t.spec.shape, es, t.file_offset, c.offsets, c.shape):
            by_file.setdefault(fi, []).append((a, b, c.rank, ci, src))
            src += b - a
    out = RankLayout(chunks=[i for i, c in enumerate(chunks) if c.rank == rank])
    for fi in sorted(by_file):
        runs = sorted(by_file[fi])
        starts = [r[0] for r in runs]
        end = plan.files[fi].size

        def owner(page_start: int) -> int:
            return runs[bisect.bisect_right(starts, page_start) - 1][2]

        pages: list[tuple[int, int]] = []  # page ranges [p0, p1) this rank writes
        for a, b, r, ci, src in runs:
            h = min(b, -(-a // PAGE) * PAGE)  # end of the head (bytes before the first page boundary)
            if h > a:
                o = owner(a - a % PAGE)
                if r == rank or o == rank:
                    if r == rank and o == rank:
                        out.copies.append((ci, src, h - a, _Pos(fi, a)))  # type: ignore[arg-type]
                    elif r == rank:
                        out.sends.setdefault(o, []).append((ci, src, h - a))
                    else:
                        out.recvs.setdefault(r, []).append((_Pos(fi, a), h - a))  # type: ignore[arg-type]
            if r == rank and b > h:
                out.copies.append((ci, src + h - a, b - h, _Pos(fi, h)))  # type: ignore[arg-type]
                p0, p1 = h // PAGE, -(-b // PAGE)
                if pages and pages[-1][1] >= p0:
                    pages[-1] = (pages[-1][0], max(pages[-1][1], p1))
                else:
                    pages.append((p0, p1))
        for p0, p1 in pages:
            out.spans.append((fi, p0 * PAGE, min(p1 * PAGE, end), out.buffer_bytes))
            out.buffer_bytes += (p1 - p0) * PAGE
    span_starts = [(fi, a) for fi, a, _, _ in out.spans]

    def at(p: _Pos) -> int:
        i = bisect.bisect_right(span_starts, (p.fi, p.x)) - 1
        fi, a, b, off = out.spans[i]
        if fi != p.fi or not a <= p.x < b:
            raise AssertionError(f"byte {p.x} of file {fi} lies in no page of rank {rank}")  # a planning bug
        return off + p.x - a

    out.copies = [(ci, s, n, at(p)) for ci, s, n, p in out.copies]
    out.recvs = {r: [(at(p), n) for p, n in v] for r, v in out.recvs.items()}
    return out


@dataclass(frozen=True, order=True)
class _Pos:
    fi: int
    x: int
