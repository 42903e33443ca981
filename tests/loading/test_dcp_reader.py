"""torch.distributed.checkpoint.load with FastCkptReader + FastCkptLoadPlanner: into an FSDP2 tiny
Llama + AdamW state in 2 spawned gloo ranks, bit-exact, the next loss equal to the uninterrupted
run's, from a plain ``fastckpt.save`` of the full tensors and from its format-2 twin (verify=True);
nothing unpickled (pickle.loads / torch.load patched to raise during the load, no ``.metadata``);
BYTE_IO under DCP's default planner refused naming FastCkptLoadPlanner."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))  # RankPool
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import RankPool  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.dcp  # noqa: E402
from fastckpt.dcp import FastCkptLoadPlanner, FastCkptReader  # noqa: E402
from fastckpt.errors import DCPLoadError  # noqa: E402
from into_helpers import LR, batches, fsdp, llama, mismatches, next_loss, rewrite_as_v2, step  # noqa: E402

TIMEOUT_S = 180


class _NoPickle:
    """Make pickle.loads and torch.load raise while active."""

    def __enter__(self):
        self.saved = pickle.loads, torch.load

        def refuse(*a, **k):
            raise AssertionError("unpickling during a fastckpt DCP load")

        pickle.loads = refuse
        torch.load = refuse
        return self

    def __exit__(self, *exc):
        pickle.loads, torch.load = self.saved


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("pool")), world_size=2)
    yield p
    p.close()


# -- rank-side functions ----------------------------------------------------------------------

def train_save_full(folder: str) -> dict:
    """FSDP2 run: one step, rank 0 saves the full tensors with plain fastckpt.save (and a v2 twin)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model = fsdp(llama(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step(model, opt, batches()[0])
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        fastckpt.save({"model": msd, "optim": osd}, os.path.join(folder, "full"))
        rewrite_as_v2(str(fastckpt.save({"model": msd, "optim": osd}, os.path.join(folder, "v2"))))
    sm, so = get_state_dict(model, opt)  # the DTensor route: every rank writes its own chunks
    fastckpt.save({"model": sm, "optim": so}, os.path.join(folder, "dtensor"))
    dist.barrier()
    return {"loss": next_loss(model, opt)}


def dcp_resume(ck: str, verify: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    model = fsdp(llama(1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with _NoPickle():
        dcp.load(state, storage_reader=FastCkptReader(ck, verify=verify), planner=FastCkptLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    want = fastckpt.load(ck)
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    bad = mismatches(full_m, want["model"]) + mismatches(full_o, want["optim"], "optim")
    return {"bad": bad, "loss": next_loss(model, opt), "lr": opt.param_groups[0]["lr"]}


# -- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(pool, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ck"))
    out = pool.run(train_save_full, folder=folder, timeout_s=TIMEOUT_S)
    return {"folder": folder, "loss": out[0]["loss"]}


@pytest.mark.parametrize("name,verify", [("full", False), ("v2", True), ("dtensor", True)])
def test_dcp_load_into_fsdp2_bit_exact(pool, ckpts, name, verify):
    ck = os.path.join(ckpts["folder"], name)
    assert not os.path.exists(os.path.join(ck, ".metadata"))
    m = fastckpt.read_manifest(ck)
    assert m.version == (1 if name == "full" else 2)
    assert any(e.chunks for e in m.tensors.values()) == (name != "full")
    out = pool.run(dcp_resume, ck=ck, verify=verify, timeout_s=TIMEOUT_S)
    for r, o in out.items():
        assert o["bad"] == [], (r, o["bad"][:5])
        assert o["lr"] == LR  # param_groups came from state.json (JSON), not from the fresh optimizer
        assert o["loss"] == ckpts["loss"], (r, o["loss"], ckpts["loss"])
    assert not os.path.exists(os.path.join(ck, ".metadata"))


def test_dtensor_save_into_one_process_plain_state(ckpts):
    """2 -> 1 through DCP: a 2-rank DTensor save read into one process's plain state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    ck = os.path.join(ckpts["folder"], "dtensor")
    model = llama(2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with _NoPickle():
        dcp.load(state, storage_reader=FastCkptReader(ck, verify=True), planner=FastCkptLoadPlanner())
    assert mismatches(state, fastckpt.load(ck)) == []


def _small(tmp_path):
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    sd, osd = get_state_dict(m, opt)
    return fastckpt.save({"model": sd, "optim": osd}, tmp_path / "ck"), sd, osd


def _fresh():
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m = torch.nn.Linear(4, 3)
    sd, osd = get_state_dict(m, torch.optim.AdamW(m.parameters(), lr=0.5))
    return {"model": sd, "optim": osd}


def test_one_process_no_pickle(tmp_path):
    ck, sd, osd = _small(tmp_path)
    state = _fresh()
    with _NoPickle():
        dcp.load(state, storage_reader=FastCkptReader(ck, verify=True), planner=FastCkptLoadPlanner())
    assert mismatches(state, {"model": sd, "optim": osd}) == []
    assert not os.path.exists(os.path.join(ck, ".metadata"))


def test_default_planner_reads_json_values_without_unpickling(tmp_path):
    """DCP's default load planner (no planner=): the non-tensor values come from state.json, never
    unpickled (issue 20; this refused before, naming FastCkptLoadPlanner)."""
    ck, sd, osd = _small(tmp_path)
    state = _fresh()
    with _NoPickle():
        dcp.load(state, storage_reader=FastCkptReader(ck))
    assert mismatches(state, {"model": sd, "optim": osd}) == []
    assert state["optim"]["param_groups"][0]["lr"] == 0.05


def test_fastckpt_dcp_load_raises_ours(tmp_path):
    ck, sd, osd = _small(tmp_path)
    state = _fresh()
    assert mismatches(fastckpt.dcp.load(state, ck), {"model": sd, "optim": osd}) == []
    state["model"]["extra"] = torch.zeros(2)
    with pytest.raises(DCPLoadError) as ei:
        fastckpt.dcp.load(state, ck)
    assert "extra" in str(ei.value) and 0 in ei.value.failures
    assert isinstance(ei.value, Exception)  # catchable as an ordinary error


def test_verify_names_the_damaged_chunk(tmp_path):
    ck, _, _ = _small(tmp_path)
    rewrite_as_v2(str(ck))
    e = fastckpt.read_manifest(ck).tensors["model/weight"]
    with open(os.path.join(ck, e.file), "r+b") as f:  # element [2, 1]: second chunk (rows 2..2)
        f.seek(e.offsets[0] + (2 * 4 + 1) * 4)
        b = f.read(1)
        f.seek(e.offsets[0] + (2 * 4 + 1) * 4)
        f.write(bytes([b[0] ^ 1]))
    dcp.load(_fresh(), storage_reader=FastCkptReader(ck, verify=False), planner=FastCkptLoadPlanner())  # unchecked when asked
    with pytest.raises(CheckpointException, match="ChecksumMismatchError"):  # checked by default (issue 20)
        dcp.load(_fresh(), storage_reader=FastCkptReader(ck), planner=FastCkptLoadPlanner())
    with pytest.raises(DCPLoadError, match=r"ChecksumMismatchError.*model/weight.*offsets \[2, 0\]"):
        fastckpt.dcp.load(_fresh(), ck, verify=True)


# -- dtype differences: cast as DCP's FileSystemReader does (issue 20, item 2) -------------------------

def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("planner", ["fastckpt", "default", "fastckpt.dcp.load+verify"])
def test_dtype_difference_is_cast_like_dcp_filesystem_reader(tmp_path, src, dst, planner):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    g = torch.Generator().manual_seed(0)
    saved = {"w": torch.tensor([[49.6, 76.8, -3.1], [1e-3, 7.0, 1234.5]]).to(src),
             "big": (torch.randn(64, 33, generator=g) * 100).to(src),
             "wt": torch.randn(2, 3, generator=g).to(src)}
    state = {"model": saved, "step": 4}
    ck = fastckpt.save(state, tmp_path / "ck")
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ref")))

    def template():  # "wt": a non-contiguous destination
        return {"model": {"w": torch.zeros(2, 3, dtype=dst), "big": torch.zeros(64, 33, dtype=dst),
                          "wt": torch.zeros(3, 2, dtype=dst).t()}, "step": 0}
    ours, ref = template(), template()
    with _NoPickle():
        if planner == "fastckpt":
            dcp.load(ours, storage_reader=FastCkptReader(ck), planner=FastCkptLoadPlanner())
        elif planner == "default":
            dcp.load(ours, storage_reader=FastCkptReader(ck))
        else:
            fastckpt.dcp.load(ours, ck, verify=True)
    dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")))  # the reference: DCP's own reader
    for k, v in saved.items():
        assert ours["model"][k].dtype == dst
        assert _raw(ours["model"][k]) == _raw(v.to(dst)), (k, ours["model"][k].flatten()[:3], v.flatten()[:3])
        assert _raw(ours["model"][k]) == _raw(ref["model"][k]), k
    assert ours["step"] == ref["step"] == 4


def test_shape_difference_is_a_typed_error(tmp_path):
    ck = fastckpt.save({"model": {"w": torch.ones(2, 3)}}, tmp_path / "ck")
    state = {"model": {"w": torch.zeros(3, 2)}}
    with pytest.raises(DCPLoadError, match=r"(?s)model\.w.*|Size mismatch") as ei:
        fastckpt.dcp.load(state, ck)
    assert "Size mismatch" in str(ei.value) and "model.w" in str(ei.value), str(ei.value)
    assert torch.equal(state["model"]["w"], torch.zeros(3, 2))
