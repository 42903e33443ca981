"""The pure region planner of load_into (fastckpt.loading.regions): for any stored piece and any
destination box, the byte runs copy exactly the overlapping elements (checked against torch
indexing), never touch bytes outside the overlap, and are as few as the layout allows."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.loading.regions import Stored, box_runs, dim0_blocks, intersect, split_runs


@st.composite
def _case(draw):
    nd = draw(st.integers(0, 4))
    full = tuple(draw(st.integers(1, 5)) for _ in range(nd))

    def box():
        off = tuple(draw(st.integers(0, n - 1)) for n in full)
        return off, tuple(draw(st.integers(1, n - o)) for o, n in zip(off, full))

    return full, box(), box(), draw(st.integers(1, 64))


@settings(max_examples=300, deadline=None)
@given(_case())
def test_runs_copy_exactly_the_overlap(case):
    full, piece, dst, cap = case
    g = torch.arange(math.prod(full), dtype=torch.float32).reshape(full) + 1
    stored = g[tuple(slice(o, o + n) for o, n in zip(*piece))].contiguous()
    pad = 12
    fbytes = bytes(pad) + stored.numpy().tobytes()
    st_ = Stored("k", "f", pad, piece[1], "F32", 4, piece[0])
    b = intersect(st_.box, dst)
    out = torch.zeros(dst[1])
    mv = memoryview(out.numpy()).cast("B")
    if b is None:
        assert any(max(a, c) >= min(a + n, c + m) for a, n, c, m in zip(piece[0], piece[1], dst[0], dst[1]))
        return
    runs = box_runs(st_, b, dst)
    for r in runs:
        assert pad <= r.file_offset and r.file_offset + r.nbytes <= len(fbytes)
    for r in split_runs(runs, cap * 4):
        assert r.nbytes <= cap * 4
        mv[r.dst_offset:r.dst_offset + r.nbytes] = fbytes[r.file_offset:r.file_offset + r.nbytes]
    rel = tuple(slice(o - d, o - d + n) for o, d, n in zip(b[0], dst[0], b[1]))
    assert torch.equal(out[rel], g[tuple(slice(o, o + n) for o, n in zip(*b))])
    mask = torch.ones(dst[1], dtype=torch.bool)
    mask[rel] = False
    assert not out[mask].any(), "a run wrote outside the overlap"
    assert sum(r.nbytes for r in runs) == math.prod(b[1]) * 4
    # runs are coalesced: a Shard(0)-like box of a full tensor is one run
    if piece == ((0,) * len(full), full) and dst[1][1:] == full[1:]:
        assert len(runs) == 1


def test_shard1_region_is_one_run_per_row():
    full = (6, 8)
    st_ = Stored("k", "f", 0, full, "F32", 4, (0, 0))
    runs = box_runs(st_, ((0, 4), (6, 4)), ((0, 4), (6, 4)))
    assert [(r.file_offset, r.dst_offset, r.nbytes) for r in runs] == [(i * 32 + 16, i * 16, 16) for i in range(6)]


def test_dim0_blocks_are_bounded_and_cover():
    blocks = dim0_blocks(((2, 0), (7, 10)), 100, 4)  # rows of 40 bytes: 2 per block
    assert [b[1][0] for b in blocks] == [2, 2, 2, 1] and blocks[0][0] == (2, 0) and blocks[-1][0] == (8, 0)
    assert dim0_blocks(((0,), (3,)), 1, 4) == [((0,), (1,)), ((1,), (1,)), ((2,), (1,))]
