"""The pure page layout of DTensor saves (fastckpt.saving.pages): simulated in memory for any number of
ranks, uneven Shard(d) splits and odd element sizes, every rank's pages, copies and edge hand-overs
rebuild the exact bytes of the full-tensor files, and no page has two writers."""

from __future__ import annotations


import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt.format.dtypes import dtype_to_str
from fastckpt.format.layout import ArraySpec, plan_save
from fastckpt.saving.pages import PAGE, Chunk, check_tiling, chunk_runs, rank_layout as layout

DTYPES = [torch.float32, torch.float16, torch.float64, torch.int8, torch.int64]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    size = -(-n // parts) if n else 0  # torch.chunk / DTensor Shard: ceil-sized pieces, the last ones short or empty
    out = []
    for r in range(parts):
        a = min(r * size, n)
        out.append((a, min(a + size, n) - a))
    return out


@st.composite
def states(draw):
    world = draw(st.integers(1, 4))
    tensors = []
    for i in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, 300 if ndim == 1 else 40)) for _ in range(ndim))
        dtype = draw(st.sampled_from(DTYPES))
        dim = draw(st.integers(-1, ndim - 1))  # -1: replicated (one rank writes it whole)
        tensors.append((f"t{i}", shape, dtype, dim))
    return world, tensors


def _simulate(world: int, tensors: list) -> None:
    g = torch.Generator().manual_seed(0)
    full = {k: (torch.randn(shape, generator=g) * 100).to(dtype) for k, shape, dtype, _ in tensors}
    specs = [ArraySpec(k, k, "model", dtype_to_str(full[k].dtype), tuple(full[k].shape),
                       full[k].numel() * full[k].element_size()) for k, *_ in tensors]
    plan = plan_save(specs, max_shard_bytes=3000, chunk_bytes=PAGE)
    chunks, local = [], {}
    for i, (k, shape, _, dim) in enumerate(tensors):
        if dim < 0:
            c = Chunk(k, (0,) * len(shape), tuple(shape), i % world)
            chunks.append(c)
            local[(k, c.rank)] = full[k]
            continue
        for r, (a, n) in enumerate(_split(shape[dim], world)):
            if n == 0:
                continue
            offs = tuple(a if d == dim else 0 for d in range(len(shape)))
            size = tuple(n if d == dim else s for d, s in enumerate(shape))
            chunks.append(Chunk(k, offs, size, r))
            local[(k, r)] = full[k].narrow(dim, a, n)
    check_tiling(plan, chunks)
    lays = {r: layout(plan, chunks, r) for r in range(world)}
    src = {ci: local[(c.key, c.rank)].contiguous().reshape(-1).view(torch.uint8) for ci, c in enumerate(chunks)}
    bufs = {r: torch.zeros(lay.buffer_bytes, dtype=torch.uint8) for r, lay in lays.items()}
    for r, lay in lays.items():
        for ci, s, n, off in lay.copies:
            bufs[r][off:off + n] = src[ci][s:s + n]
    for r, lay in lays.items():  # hand the edge bytes over, in the order the receiver expects them
        for dst, items in lay.sends.items():
            blob = torch.cat([src[ci][s:s + n] for ci, s, n in items])
            pos = 0
            for off, n in lays[dst].recvs[r]:
                bufs[dst][off:off + n] = blob[pos:pos + n]
                pos += n
            assert pos == blob.numel()
    files = {fi: bytearray(f.size) for fi, f in enumerate(plan.files)}
    owner: dict[tuple[int, int], int] = {}
    for r, lay in lays.items():
        for fi, a, b, off in lay.spans:
            assert a % PAGE == 0 and off % PAGE == 0 and (b % PAGE == 0 or b == plan.files[fi].size)
            files[fi][a:b] = bufs[r][off:off + b - a].numpy().tobytes()
            for p in range(a // PAGE, -(-b // PAGE)):
                assert (fi, p) not in owner, f"page {p} of file {fi} written by ranks {owner[(fi, p)]} and {r}"
                owner[(fi, p)] = r
    for fi, f in enumerate(plan.files):
        data = files[fi][f.data_offset:]
        want = b"".join(full[t.spec.key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in f.tensors)
        assert bytes(data) == want, f.name
        assert sum(1 for (x, _) in owner if x == fi) == -(-(f.size - f.data_offset) // PAGE)


@settings(max_examples=60, deadline=None)
@given(states())
def test_layout_rebuilds_the_full_files(case):
    _simulate(*case)


def test_shard1_rows_are_runs_and_chunks_must_tile():
    # a [5, 37] fp32 tensor, columns 19.. of it: one 72-byte run per row, 148 bytes apart
    runs = chunk_runs((5, 37), 4, 1000, (0, 19), (5, 18))
    assert runs == [(1000 + 76 + 148 * i, 1000 + 148 * (i + 1)) for i in range(5)]
    assert chunk_runs((7, 33), 4, 0, (4, 0), (3, 33)) == [(4 * 132, 7 * 132)]  # Shard(0): one range
    spec = ArraySpec("w", "w", "model", "F32", (4, 4), 64)
    plan = plan_save([spec], max_shard_bytes=1 << 20, chunk_bytes=PAGE)
    try:
        check_tiling(plan, [Chunk("w", (0, 0), (2, 4), 0)])
    except ValueError as e:
        assert "cover 8 of 16" in str(e)
    else:
        raise AssertionError("a chunk list leaving half the tensor uncovered was accepted")
