"""accelerate plugin with FSDP2 (DTensor) models: 2 spawned ranks, gloo, CPU.

accelerate 1.15 enables its FSDP plugin on accelerator devices only (``Accelerator(cpu=True)``
in 2 processes is ``MULTI_CPU``, whose ``prepare`` refuses a model with DTensor parameters:
"incompatible with DDP"). So each rank wraps a tiny fp32 Llama with ``fully_shard`` itself
and registers it the way accelerate's FSDP2 path leaves it (``accelerator._models.append(model)``,
what ``prepare_model`` does before ``fsdp2_prepare_model``); optimizer, scheduler and dataloader
go through ``accelerator.prepare``. The save/load calls are accelerate's own
(``accelerator.save_state`` / ``load_state``), bound by ``fastckpt.integrations.accelerate.plugin.enable``.

Checked: save_state -> fresh model (other init, RNG moved on) -> load_state restores every rank's
parameter shards and optimizer state bit-exactly and each rank's own RNG state; the next epoch's
losses equal the uninterrupted run's on each rank; the folder is one committed HF-layout
checkpoint that ``transformers.from_pretrained`` reads with the full weights; at world size 1 the
2-rank checkpoint restores model and optimizer (resharded by ``load_into``) and a warning names
saved rank 1 whose RNG state was not used; FSDP1 is refused with a typed error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("accelerate")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

sys.path.insert(0, str(REPO / "tests" / "saving"))
from ranks import RankPool  # noqa: E402

import fastckpt  # noqa: E402

TIMEOUT_S = 180


# -- in the ranks ---------------------------------------------------------------------------------

def _accelerator(project: str):
    """``Accelerator(cpu=True)`` on the pool's gloo group (accelerate reads the launcher's env)."""
    import torch.distributed as dist
    for k, v in dict(RANK=dist.get_rank(), LOCAL_RANK=dist.get_rank(), WORLD_SIZE=dist.get_world_size(),
                     LOCAL_WORLD_SIZE=dist.get_world_size(), MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        os.environ[k] = str(v)
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project,
                                                                    automatic_checkpoint_naming=True))
    assert acc.num_processes == dist.get_world_size() and acc.process_index == dist.get_rank()
    return acc


def _setup(project: str, seed: int, vocab: int = 131):
    """Accelerator + fully_shard'ed tiny Llama (fp32, dropout on) + AdamW + StepLR + shuffled dataloader."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(REPO))
    from integrations.accelerate import plugin as fca
    from integrations.hf.models import tiny_llama
    acc = _accelerator(project)
    model = tiny_llama(seed=seed, vocab_size=vocab)  # odd vocab: uneven Shard(0) of embed/lm_head (66/65)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc._models.append(model)  # what accelerate's FSDP2 prepare leaves registered (see module docstring)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = [(torch.arange(8) * (i + 3)) % 131 for i in range(16)]
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    opt, sched, dl = acc.prepare(opt, sched, dl)
    plugin = fca.enable(acc)
    return acc, model, opt, sched, dl, plugin


def _epoch(acc, model, opt, sched, dl) -> list[float]:
    losses = []
    for x in dl:
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k, v in sorted(tensors.items()):
        h.update(k.encode())
        h.update(str(v.dtype).encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _local(model, opt) -> dict[str, str]:
    """Digests of this rank's parameter shards and optimizer state (DTensor local shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    msd, osd = get_state_dict(model, getattr(opt, "optimizer", opt))

    def loc(t):
        return t.to_local() if isinstance(t, DTensor) else t
    flat = {f"opt/{k}/{n}": loc(v) for k, s in osd["state"].items() for n, v in s.items()}
    return {"model": _digest({k: loc(v) for k, v in msd.items()}), "optim": _digest(flat),
            "lr": repr([g["lr"] for g in osd["param_groups"]])}


def _full(model, opt) -> dict[str, str]:
    """Digests of the full (gathered) parameters and optimizer state (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, getattr(opt, "optimizer", opt), options=StateDictOptions(full_state_dict=True))
    flat = {f"opt/{k}/{n}": v for k, s in osd["state"].items() for n, v in s.items()}
    return {"model": _digest(msd), "optim": _digest(flat)}


def _rng() -> str:
    import random

    import numpy as np
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes() + repr(random.getstate()).encode()
                          + np.random.get_state()[1].tobytes()).hexdigest()


def rank_train(project: str) -> dict:
    """Reference run: epoch 0, save_state (checkpoint_0), epoch 1 (the losses a resume must repeat)."""
    from accelerate.utils import set_seed
    acc, model, opt, sched, dl, plugin = _setup(project, seed=0)
    set_seed(7, device_specific=True)  # every rank its own RNG stream (dropout differs per rank)
    res = {"epoch0": _epoch(acc, model, opt, sched, dl)}
    res["rng"] = _rng()
    acc.step = 5  # accelerate counts it in accumulate(); a value load_state must bring back
    seen = []

    def hook(models, weights, output_dir):  # accelerate's FSDP path: models listed, weights empty
        seen.append((len(models), len(weights)))
        Path(output_dir, "note.txt").write_text("written by a save pre-hook")
    handle = acc.register_save_state_pre_hook(hook)
    res["saved"] = str(acc.save_state())
    handle.remove()
    res["hook"] = seen
    assert _rng() == res["rng"]  # saving draws nothing from the RNG
    res["local"] = _local(model, opt)
    res["full"] = _full(model, opt)
    res["epoch1"] = _epoch(acc, model, opt, sched, dl)
    res["full1"] = _full(model, opt)
    plugin.async_save = True
    res["saved"] = [res["saved"], str(acc.save_state())]  # returns after staging
    _epoch(acc, model, opt, sched, dl)  # trains on while the save is written: must not leak into it
    plugin.wait()  # every rank
    return res


def rank_resume(project: str, folder: str) -> dict:
    """Fresh model (other init), RNG moved on, then load_state(folder) and epoch 1."""
    acc, model, opt, sched, dl, plugin = _setup(project, seed=1)
    torch.manual_seed(1234 + acc.process_index)
    _epoch(acc, model, opt, sched, dl)  # diverge: params, optimizer, scheduler, RNG all move
    res = {"before": _local(model, opt), "hook": []}
    acc.register_load_state_pre_hook(lambda models, input_dir: res["hook"].append((len(models), input_dir)))
    acc.load_state(folder)
    res["rng"] = _rng()
    res["local"] = _local(model, opt)
    res["full"] = _full(model, opt)
    res["epoch1"] = _epoch(acc, model, opt, sched, dl)
    res["iteration"] = acc.project_configuration.iteration
    res["step"] = acc.step
    return res


def rank_resume_world1(project: str, folder: str) -> dict:
    """World size 1: the 2-rank checkpoint into a one-rank fully_shard model; warnings collected."""
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Grab(level=logging.WARNING)
    logging.getLogger("integrations.accelerate.fsdp2").addHandler(handler)
    try:
        acc, model, opt, sched, dl, plugin = _setup(project, seed=1)
        acc.load_state(folder)
        return {"full": _full(model, opt), "lr": _local(model, opt)["lr"], "rng": _rng(), "warnings": records}
    finally:
        logging.getLogger("integrations.accelerate.fsdp2").removeHandler(handler)


def rank_fsdp1_refused() -> dict:
    """A FullyShardedDataParallel (FSDP1) model registered with the accelerator is refused, typed."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    sys.path.insert(0, str(REPO))
    from integrations.accelerate import plugin as fca
    from integrations.hf.models import tiny_llama
    acc = _accelerator("unused")
    acc._models.append(FullyShardedDataParallel(tiny_llama(seed=0), device_id=torch.device("cpu")))
    try:
        fca.enable(acc)
    except NotImplementedError as e:
        return {"type": type(e).__name__, "message": str(e)}
    finally:
        acc._models.clear()
    return {"type": None}


# -- the tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("accfsdp2pool")), world_size=2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def trained(pool, tmp_path_factory):
    project = tmp_path_factory.mktemp("accfsdp2") / "run"
    ref = pool.run(rank_train, project=str(project), timeout_s=TIMEOUT_S)
    return project, ref


def test_save_state_writes_one_hf_checkpoint(trained):
    project, ref = trained
    folder = project / "checkpoints" / "checkpoint_0"
    assert ref[0]["saved"] == ref[1]["saved"] == [str(folder), str(folder.with_name("checkpoint_1"))]
    # one committed folder per save, no temp folders left
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert fastckpt.is_committed(folder) and fastckpt.is_committed(folder.with_name("checkpoint_1"))
    assert not list(folder.glob("*.pt")) and not list(folder.glob("*.bin")) and not list(folder.glob("*.pkl"))
    assert ref[0]["hook"] == ref[1]["hook"] == [(1, 0)]
    assert (folder / "note.txt").read_text() == "written by a save pre-hook"  # committed with the checkpoint
    assert ref[0]["epoch0"] != ref[1]["epoch0"]  # ranks see different data and dropout
    assert ref[0]["local"]["model"] != ref[1]["local"]["model"]  # each rank holds another shard
    assert ref[0]["full"] == ref[1]["full"]
    # transformers reads the model weights as saved: the full (gathered) parameters
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert _digest(hf.state_dict()) == ref[0]["full"]["model"]
    raw = {}
    for f in folder.glob("model*.safetensors"):
        raw.update(load_file(f))
    assert raw["model.embed_tokens.weight"].shape == (131, 32)  # full tensors, not shards
    # the asynchronous save holds the values at the call, not the epoch trained while it was written
    hf1 = LlamaForCausalLM.from_pretrained(folder.with_name("checkpoint_1"), dtype=torch.float32)
    assert _digest(hf1.state_dict()) == ref[0]["full1"]["model"] != ref[0]["full"]["model"]
    snap = fastckpt.load(folder, keys=["rng_per_process", "step"])
    assert len(snap["rng_per_process"]) == 2 and snap["step"] == 5


def test_load_state_resumes_each_rank_exactly(pool, trained, tmp_path):
    project, ref = trained
    folder = project / "checkpoints" / "checkpoint_0"
    got = pool.run(rank_resume, project=str(tmp_path / "run2"), folder=str(folder), timeout_s=TIMEOUT_S)
    for r in range(2):
        g, w = got[r], ref[r]
        assert g["before"]["model"] != w["local"]["model"], r  # the load had something to undo
        assert g["local"] == w["local"], r  # this rank's parameter and optimizer shards, bit-exact; lr too
        assert g["full"] == w["full"], r
        assert g["rng"] == w["rng"], r  # this rank's own RNG state, not rank 0's
        assert g["epoch1"] == w["epoch1"], r  # the next losses equal the uninterrupted run's
        assert g["iteration"] == 1, r  # automatic naming continues after the loaded checkpoint
        assert g["step"] == 5, r
        assert g["hook"] == [(0, str(folder))], r  # accelerate's FSDP path: models are not the hooks' to load
    assert got[0]["rng"] != got[1]["rng"]


def test_resume_at_world_size_1(trained, tmp_path):
    project, ref = trained
    folder = project / "checkpoints" / "checkpoint_0"
    (tmp_path / "pool1").mkdir()
    one = RankPool(str(tmp_path / "pool1"), world_size=1)  # another world size: its own pool
    try:
        got = one.run(rank_resume_world1, project=str(tmp_path / "run1"), folder=str(folder), timeout_s=TIMEOUT_S)[0]
    finally:
        one.close()
    assert got["full"] == ref[0]["full"]  # model and optimizer resharded from 2 ranks to 1, bit-exact
    assert got["lr"] == ref[0]["local"]["lr"]
    assert got["rng"] == ref[0]["rng"]  # rank 0 takes saved rank 0's RNG state
    warned = [w for w in got["warnings"] if "RNG states of saved rank(s) [1] were not used" in w]
    assert len(warned) == 1, got["warnings"]
    assert any("dataloader positions of saved rank(s) [1]" in w for w in got["warnings"]), got["warnings"]


def test_fsdp1_is_refused_typed(pool):
    got = pool.run(rank_fsdp1_refused, timeout_s=TIMEOUT_S)
    for r in range(2):
        assert got[r]["type"] == "AccelerateFSDP1Error", got[r]
        assert "FSDP2" in got[r]["message"] and "fully_shard" in got[r]["message"]


def rank_load_refused(project: str, folder: str) -> dict:
    """load_state of a checkpoint saved from non-sharded (DDP) models into FSDP2 models."""
    acc, model, opt, sched, dl, plugin = _setup(project, seed=1)
    before = _local(model, opt)
    try:
        acc.load_state(folder)
    except Exception as e:
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "unchanged": _local(model, opt) == before}
    return {"type": None}


def test_ddp_checkpoint_refused_for_fsdp2_models(pool, tmp_path):
    sys.path.insert(0, str(REPO))
    from integrations.hf.models import tiny_llama
    folder = tmp_path / "ddp_ckpt"  # the layout the plugin writes for DDP models (rank 0 alone)
    fastckpt.save({"model": tiny_llama(seed=0, vocab_size=131).state_dict(), "optimizers": [{}], "schedulers": [{}],
                   "custom": [], "scaler": None, "samplers": [None], "rng": {"cpu": torch.get_rng_state()},
                   "step": 0}, folder, weights={"model": "model"})
    got = pool.run(rank_load_refused, project=str(tmp_path / "run3"), folder=str(folder), timeout_s=TIMEOUT_S)
    for r in range(2):
        assert got[r]["type"] == "AccelerateStateError", got[r]
        assert "ValueError" in got[r]["mro"] and str(folder) in got[r]["message"], got[r]
        assert got[r]["unchanged"], r  # nothing was loaded


def rank_load_other_shape(project: str, folder: str) -> dict:
    """load_state into FSDP2 models whose embeddings have another vocabulary size, strict and not."""
    acc, model, opt, sched, dl, plugin = _setup(project, seed=1, vocab=133)
    before = _local(model, opt)
    out = {}
    for strict in (True, False):
        try:
            acc.load_state(folder, strict=strict)
            out[strict] = None
        except Exception as e:
            out[strict] = {"type": type(e).__name__, "message": str(e), "unchanged": _local(model, opt) == before}
    return out


def test_other_shapes_refused_even_without_strict(pool, trained, tmp_path):
    """As torch's load_state_dict(strict=False) and accelerate's FSDP (DCP) load: shapes must match."""
    project, _ = trained
    folder = project / "checkpoints" / "checkpoint_0"
    got = pool.run(rank_load_other_shape, project=str(tmp_path / "run4"), folder=str(folder), timeout_s=TIMEOUT_S)
    for r in range(2):
        for strict in (True, False):
            g = got[r][strict]
            assert g is not None and g["type"] == "StateMismatchError", (r, strict, g)
            assert "embed_tokens" in g["message"] and "133" in g["message"] and "131" in g["message"], g["message"]
            assert g["unchanged"], (r, strict)
