"""load_into across world sizes with a real FSDP2 (``fully_shard``) tiny Llama + AdamW, 2 spawned
gloo ranks on CPU: 2 -> 2 (fresh model, new mesh), 1 -> 2, 2 -> 1 (the DTensor routes' format-2
folders) and plain HF folders; every tensor bit-exact, each rank reading only its
shard's bytes, and the resumed run's next loss equal to the uninterrupted run's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))  # RankPool
from ranks import RankPool  # noqa: E402

import fastckpt  # noqa: E402
from into_helpers import (LR, CountingBackend, batches, fsdp, llama, local_bytes, mismatches,  # noqa: E402
                          next_loss, step, tensor_leaves)

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("pool")), world_size=2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def ckpts(pool, tmp_path_factory):
    """Checkpoints of one training step: 'full2' (plain save of full tensors from rank 0 of an FSDP2
    run), 'solo' (one process), HF folders."""
    folder = str(tmp_path_factory.mktemp("ck"))
    out = pool.run(train_and_save, folder=folder, timeout_s=TIMEOUT_S)
    solo = pool.run(train_and_save_solo, ranks=[0], folder=folder, timeout_s=TIMEOUT_S)
    return {"folder": folder, "loss2": out[0]["loss"], "loss1": solo[0]["loss"], **out[0]}


# -- rank-side functions ----------------------------------------------------------------------

def train_and_save(folder: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model = fsdp(llama(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step(model, opt, batches()[0])
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        fastckpt.save({"model": msd, "optim": osd}, os.path.join(folder, "full2"))
        plain = llama(5)
        plain.load_state_dict(msd)
        plain.save_pretrained(os.path.join(folder, "hf"), safe_serialization=True)
        plain.save_pretrained(os.path.join(folder, "hf_sharded"), safe_serialization=True, max_shard_size="40KB")
    sm, so = get_state_dict(model, opt)
    # the DTensor routes (format 2): fastckpt.save of the sharded state, and dcp.save with our writer
    fastckpt.save({"model": sm, "optim": so}, os.path.join(folder, "dtensor2"))
    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastCkptSavePlanner, FastCkptWriter
    dcp.save({"model": sm, "optim": so}, storage_writer=FastCkptWriter(os.path.join(folder, "dcp2")),
             planner=FastCkptSavePlanner())
    dist.barrier()
    return {"loss": next_loss(model, opt)}


def train_and_save_solo(folder: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step(model, opt, batches()[0])
    msd, osd = get_state_dict(model, opt)
    fastckpt.save({"model": msd, "optim": osd}, os.path.join(folder, "solo"))
    return {"loss": next_loss(model, opt)}


def resume_fsdp(ck: str, with_optim: bool = True) -> dict:
    """A fresh FSDP2 model (other init, new mesh) filled with load_into from ``ck``; bit-exactness
    against the checkpoint's full tensors, bytes read, and the next loss."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    model = fsdp(llama(1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 3)
    msd, osd = get_state_dict(model, opt)
    counter = CountingBackend()
    if with_optim:
        state = fastckpt.load_into({"model": msd, "optim": osd}, ck, io_backend=counter, verify=False)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        want = fastckpt.load(ck)
    else:  # an HF folder: model weights only, matched by tensor name
        state = {"model": fastckpt.load_into(msd, ck, io_backend=counter)}
        want = {"model": fastckpt.load(ck)}
    expected = local_bytes(state)
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    bad = mismatches(full_m, want["model"])
    if with_optim:
        bad += mismatches(full_o, want["optim"], "optim")
    total = sum(t.numel() * t.element_size() for t in tensor_leaves(want))
    loss = next_loss(model, opt) if with_optim else None
    return {"bad": bad, "read": counter.bytes, "expected": expected, "total": total, "loss": loss}


def resume_plain(ck: str) -> dict:
    """One process (no FSDP): load_into a plain model + AdamW state from ``ck``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = llama(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 3)
    msd, osd = get_state_dict(model, opt)
    state = fastckpt.load_into({"model": msd, "optim": osd}, ck, verify=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    whole = fastckpt.load(ck)
    m2, o2 = get_state_dict(model, opt)
    bad = mismatches(m2, whole["model"]) + mismatches(o2, whole["optim"], "optim")
    return {"bad": bad, "loss": next_loss(model, opt)}


def fresh_sharded_optimizer(ck: str) -> dict:
    """A fresh FSDP2 optimizer's own state_dict() (``state: {}``, not get_state_dict's) against a
    checkpoint of DTensors: refused, naming get_state_dict (its full tensors are not what a sharded
    optimizer takes)."""
    model = fsdp(llama(1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        fastckpt.load_into({"model": model.state_dict(), "optim": opt.state_dict()}, ck)
    except fastckpt.errors.StateMismatchError as e:
        return {"error": str(e), "state": opt.state_dict()["state"]}
    return {"error": None}


def dtensor_placements(folder: str) -> dict:
    """Shard(1) (uneven: 5 columns on 2 ranks), Shard(0) (uneven rows) and Replicate DTensors filled
    from a full-tensor checkpoint: each rank's local part equals the full tensor's, bytes = its part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    ck = os.path.join(folder, "placements")
    full = {"a": torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5), "b": torch.arange(3 * 4 * 6).reshape(3, 4, 6),
            "c": torch.randn(9, 4, generator=torch.Generator().manual_seed(0))}
    if dist.get_rank() == 0:
        fastckpt.save(full, ck)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,))
    state = {"a": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)]),
             "b": distribute_tensor(torch.zeros(3, 4, 6, dtype=torch.int64), mesh, [Shard(2)]),
             "c": distribute_tensor(torch.zeros(9, 4), mesh, [Replicate()])}
    counter = CountingBackend()
    fastckpt.load_into(state, ck, io_backend=counter, verify=False)  # the fill alone reads only this rank's part
    bad = [k for k in full if not torch.equal(state[k].full_tensor(), full[k])]
    fastckpt.load_into(state, ck, verify=True)  # partial regions: the whole-tensor xxh3 is read and checked
    return {"bad": bad, "read": counter.bytes, "expected": local_bytes(state)}


def dtensor_cast(folder: str) -> dict:
    """issue 20: DTensors of another dtype than the checkpoint's (fp32 file -> bf16 Shard(1), bf16 file ->
    fp32 Shard(0)) get the saved values cast as DCP's reader casts, checksums checked (the default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    ck = os.path.join(folder, "cast")
    g = torch.Generator().manual_seed(1)
    full = {"a": torch.randn(7, 5, generator=g, dtype=torch.float64).mul(100).float(),
            "b": torch.randn(9, 4, generator=g).to(torch.bfloat16)}
    if dist.get_rank() == 0:
        fastckpt.save(full, ck)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,))
    state = {"a": distribute_tensor(torch.zeros(7, 5, dtype=torch.bfloat16), mesh, [Shard(1)]),
             "b": distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0)])}
    fastckpt.load_into(state, ck)
    want = {"a": full["a"].to(torch.bfloat16), "b": full["b"].float()}
    return {"bad": [k for k in full if not torch.equal(state[k].full_tensor().view(torch.uint8),
                                                       want[k].view(torch.uint8))],
            "dtypes": [str(state[k].dtype) for k in ("a", "b")]}


def rank_local_case(folder: str) -> dict:
    """A multi-rank save with a rank-local subtree (local_keys): each rank fills its own back."""
    r = dist.get_rank()
    ck = os.path.join(folder, "local")
    fastckpt.save({"w": torch.arange(4.0), "opt": {"m": torch.full((2,), float(r)), "n": r}}, ck,
                  process_group=dist.group.WORLD, local_keys=("opt",), timeout_s=60)
    dst = {"w": torch.zeros(4), "opt": {"m": torch.zeros(2), "n": -1}}
    out = fastckpt.load_into(dst, ck)
    # JSON values alone under a local key (DISTRIBUTED.md's samples-seen counter), on both routes: the
    # save succeeded but stored no per-rank skeleton, and the resume said 'missing' (a README trial)
    seen = {}
    for route, model in (("process_group", {"w": torch.arange(4.0)}), ("dtensor", None)):
        if model is None:
            from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            model = {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
        p = os.path.join(folder, f"seen-{route}")
        fastckpt.save({**model, "seen": 100 + r, "data": {"epoch": 3, "idx": [r, r + 2]}}, p,
                      local_keys=("seen", "data"), timeout_s=60,
                      **({"process_group": dist.group.WORLD} if route == "process_group" else {}))
        got = fastckpt.load_into({**model, "seen": 0, "data": {"epoch": 0, "idx": [0, 0]}}, p)
        seen[route] = [got["seen"], got["data"]]
    return {"w": dst["w"].tolist(), "m": dst["opt"]["m"].tolist(), "n": out["opt"]["n"], "seen": seen}


# -- tests ------------------------------------------------------------------------------------

def _check(out: dict, ref_loss: float, exact: bool) -> None:
    for r, o in out.items():
        assert o["bad"] == [], f"rank {r}: tensors differ from the checkpoint: {o['bad'][:5]}"
        # each rank read exactly its shard (plus the replicated optimizer step scalars), not the model
        assert 0 < o["read"] == o["expected"], (r, o)
        assert o["read"] < 0.6 * o["total"], (r, o)
        if exact:
            assert o["loss"] == ref_loss, (r, o["loss"], ref_loss)
        else:  # another world size: the same math, other reduction order
            assert o["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (r, o["loss"], ref_loss)


def test_fsdp2_2_to_2_new_mesh_bit_exact(pool, ckpts):
    out = pool.run(resume_fsdp, ck=os.path.join(ckpts["folder"], "full2"), timeout_s=TIMEOUT_S)
    _check(out, ckpts["loss2"], exact=True)


def test_fsdp2_1_to_2(pool, ckpts):
    out = pool.run(resume_fsdp, ck=os.path.join(ckpts["folder"], "solo"), timeout_s=TIMEOUT_S)
    _check(out, ckpts["loss1"], exact=False)


@pytest.mark.parametrize("name", ["dtensor2", "dcp2"])
def test_fsdp2_dtensor_save_round_trips_2_to_2_and_2_to_1(pool, ckpts, name):
    """The save side's format-2 folders (fastckpt.save of DTensors; dcp.save with FastCkptWriter):
    byte-identical to the plain full-tensor save, verified, and resumed 2 -> 2 and 2 -> 1 exactly."""
    ck = os.path.join(ckpts["folder"], name)
    m = fastckpt.read_manifest(ck)
    assert m.version == 2 and any(e.chunks for e in m.tensors.values()), m.version
    assert fastckpt.verify(ck).ok
    full = os.path.join(ckpts["folder"], "full2")
    for f in os.listdir(ck):
        if f.endswith(".safetensors"):
            with open(os.path.join(ck, f), "rb") as a, open(os.path.join(full, f), "rb") as b:
                assert a.read() == b.read(), f
    out = pool.run(resume_fsdp, ck=ck, timeout_s=TIMEOUT_S)
    _check(out, ckpts["loss2"], exact=True)
    one = pool.run(resume_plain, ranks=[0], ck=ck, timeout_s=TIMEOUT_S)[0]
    assert one["bad"] == [], one["bad"][:5]
    assert one["loss"] == pytest.approx(ckpts["loss2"], rel=1e-5, abs=1e-6)


def test_fresh_sharded_optimizer_state_is_refused_naming_get_state_dict(pool, ckpts):
    out = pool.run(fresh_sharded_optimizer, ck=os.path.join(ckpts["folder"], "dtensor2"), timeout_s=TIMEOUT_S)
    for r, o in out.items():
        assert o["error"] and "'optim/state': empty in the state" in o["error"], (r, o)
        assert "get_state_dict(model, optim)" in o["error"] and o["state"] == {}, (r, o)


@pytest.mark.parametrize("name", ["hf", "hf_sharded"])
def test_hf_folder_into_fsdp2(pool, ckpts, name):
    ck = os.path.join(ckpts["folder"], name)
    if name == "hf_sharded":
        assert os.path.exists(os.path.join(ck, "model.safetensors.index.json")), os.listdir(ck)
    out = pool.run(resume_fsdp, ck=ck, with_optim=False, timeout_s=TIMEOUT_S)
    for r, o in out.items():
        assert o["bad"] == [], (r, o["bad"][:5])
        assert o["read"] == o["expected"] and o["read"] < 0.6 * o["total"], (r, o)


def test_hf_folder_prefixed_state_one_process(ckpts):
    model = llama(3)
    sd = model.state_dict()
    out = fastckpt.load_into({"model": sd}, os.path.join(ckpts["folder"], "hf_sharded"))
    want = fastckpt.load(os.path.join(ckpts["folder"], "full2"))["model"]
    assert out["model"] is not None and mismatches(dict(model.state_dict()), want) == []


def test_dtensor_shard1_uneven_and_replicate(pool, tmp_path):
    out = pool.run(dtensor_placements, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, o in out.items():
        assert o["bad"] == [] and 0 < o["read"] == o["expected"], (r, o)


def test_dtensor_of_another_dtype_is_cast(pool, tmp_path):
    out = pool.run(dtensor_cast, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, o in out.items():
        assert o["bad"] == [] and o["dtypes"] == ["torch.bfloat16", "torch.float32"], (r, o)


def test_rank_local_subtrees(pool, tmp_path):
    out = pool.run(rank_local_case, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, o in out.items():
        want = [100 + r, {"epoch": 3, "idx": [r, r + 2]}]
        assert o == {"w": [0.0, 1.0, 2.0, 3.0], "m": [float(r)] * 2, "n": r,
                     "seen": {"process_group": want, "dtensor": want}}, (r, o)
    ck = tmp_path / "local"
    dst = {"w": torch.zeros(4), "opt": {"m": torch.zeros(2), "n": -1}}
    assert fastckpt.load_into(dst, ck, local_rank=1)["opt"]["n"] == 1 and dst["opt"]["m"].tolist() == [1.0, 1.0]
    with pytest.raises(fastckpt.errors.ShardedCheckpointError, match="load_into"):
        fastckpt.load(ck)  # never a {'__rank_local__': ...} placeholder
    assert torch.equal(fastckpt.load(ck, keys="w")["w"], torch.arange(4.0))

