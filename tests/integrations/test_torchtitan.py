"""torchtitan's real CheckpointManager through fastckpt (integrations/torchtitan.py).

2 spawned ranks, gloo, CPU; a tiny transformers Llama (fp32) sharded with FSDP2 ``fully_shard``,
torchtitan's own OptimizersContainer (AdamW) and LRSchedulersContainer, one rank pool per module.
Each test drives the manager the way torchtitan's trainer does: ``save(step)``,
``maybe_wait_for_saving()``, then a fresh model + manager ``load()``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("fastckpt.dcp", reason="fastckpt.dcp comes with the dtensor/loadinto branches")

import torch  # noqa: E402

import fastckpt  # noqa: E402

TIMEOUT_S = 180  # every pool call is bounded: a hung rank fails the test (RankTimeout)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from ranks import RankPool
    p = RankPool(str(tmp_path_factory.mktemp("tt-pool")), world_size=2)
    yield p
    p.close()


# ----------------------------------------------------------------------------------------------
# rank side
# ----------------------------------------------------------------------------------------------
class _TrainState:
    """A torchtitan-style extra Stateful (like its TrainState): step and a tensor."""

    def __init__(self):
        self.step, self.tokens = 0, torch.zeros(1, dtype=torch.int64)

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd):
        self.step, self.tokens = sd["step"], sd["tokens"]


def _setup(seed: int, intermediate: int = 64, dtype: torch.dtype = torch.float32):
    """(model, optimizers, lr_schedulers, train_state): FSDP2 tiny Llama (``dtype``), torchtitan containers."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=10)
    return model, opt, sched, _TrainState()


def _step(model, opt, sched, ts, i: int) -> float:
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    ts.step += 1
    ts.tokens += ids.numel()
    return float(loss)


def _manager(cls, folder: str, parts, *, async_mode="disabled", keep=0, interval=1):
    model, opt, sched, ts = parts
    return cls.Config(enable=True, folder="checkpoint", interval=interval, keep_latest_k=keep,
                      async_mode=async_mode).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
        states={"train_state": ts}, sd_adapter=None, base_folder=folder)


def _full(sd: dict) -> dict:
    """``{key: full tensor}`` (DTensors gathered; every rank calls it) for a flat state dict."""
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def rank_round_trip(folder: str, async_mode: str) -> dict:
    """Train 1 step, save step 1 with torchtitan's manager, load into a fresh model, compare."""
    import torch.distributed as dist
    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M

    parts = _setup(0)
    model, opt, sched, ts = parts
    _step(*parts, 0)
    mgr = _manager(M, folder, parts, async_mode=async_mode)
    assert mgr.save(curr_step=1)
    mgr.maybe_wait_for_saving()
    want_model, want_opt = _full(model.state_dict()), _full(opt.state_dict())
    want_loss = _step(*parts, 1)  # the uninterrupted run's next step
    mgr.close()
    dist.barrier()

    fresh = _setup(1)
    mgr2 = _manager(M, folder, fresh)
    assert mgr2.load() is True
    got_model, got_opt = _full(fresh[0].state_dict()), _full(fresh[1].state_dict())
    out = {
        "model_same": sorted(k for k in want_model if _raw(want_model[k]) == _raw(got_model[k])),
        "model_keys": sorted(want_model), "got_model_keys": sorted(got_model),
        "opt_same": sorted(k for k in want_opt if k in got_opt and _raw(want_opt[k]) == _raw(got_opt[k])),
        "opt_keys": sorted(want_opt),
        "last_epoch": fresh[2].schedulers[0].last_epoch, "want_last_epoch": sched.schedulers[0].last_epoch - 1,
        "train_step": fresh[3].step, "tokens": int(fresh[3].tokens),
        "next_loss": _step(*fresh, 1), "want_next_loss": want_loss,
        "full_model": {k: v for k, v in want_model.items()} if dist.get_rank() == 0 else None,
    }
    mgr2.close()
    return out


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_save_then_load_bit_exact_and_hf_layout(pool, tmp_path, async_mode):
    folder = str(tmp_path)
    res = pool.run(rank_round_trip, folder=folder, async_mode=async_mode, timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["got_model_keys"] == out["model_keys"], r
        assert out["model_same"] == out["model_keys"], (r, set(out["model_keys"]) - set(out["model_same"]))
        assert out["opt_keys"] and out["opt_same"] == out["opt_keys"], (r, set(out["opt_keys"]) - set(out["opt_same"]))
        assert out["last_epoch"] == out["want_last_epoch"] == 1, r
        assert (out["train_step"], out["tokens"]) == (1, 32), r
        assert out["next_loss"] == out["want_next_loss"], r  # bit-identical resume
    step = os.path.join(folder, "checkpoint", "step-1")
    assert fastckpt.is_committed(step)
    names = os.listdir(step)
    assert ".metadata" not in names and not any(n.endswith(".distcp") for n in names), names
    # an HF-layout folder: the model's own names, full tensors, read by the safetensors package;
    # one shard is model.safetensors without an index, as save_pretrained writes it
    from safetensors import safe_open
    assert "model.safetensors.index.json" not in names, names
    full = res[0]["full_model"]
    with safe_open(os.path.join(step, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(full)
        for name in full:
            assert _raw(f.get_tensor(name)) == _raw(full[name]), name


def rank_retention(folder: str) -> dict:
    """keep_latest_k=2 over steps 1..3; newest step ignores temporaries and unfinished folders."""
    import torch.distributed as dist
    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M

    parts = _setup(0)
    mgr = _manager(M, folder, parts, keep=2)
    for s in (1, 2, 3):
        _step(*parts, s)
        assert mgr.save(curr_step=s)
    dist.barrier()
    root = os.path.join(folder, "checkpoint")
    if dist.get_rank() == 0:
        # a crashed writer's hidden temporary of step 9 and a step-7 with no commit marker
        for name in (".step-9.fastckpt-tmp-1@00000000-0", "step-7"):
            os.makedirs(os.path.join(root, name))
            open(os.path.join(root, name, "model.safetensors.index.json"), "w").write("{}")
    dist.barrier()
    out = {"listing": sorted(os.listdir(root)), "newest": mgr._find_load_step()}
    mgr.close()
    return out


def test_keep_latest_k_and_newest_committed_step(pool, tmp_path):
    res = pool.run(rank_retention, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert "step-1" not in out["listing"] and {"step-2", "step-3"} <= set(out["listing"]), out
        assert out["newest"] == 3, out  # torchtitan's own scan would pick 9 or 7 here


def rank_failure(folder: str) -> dict:
    """Rank 1's writes fail: typed error on every rank, nothing committed, next save works."""
    import torch.distributed as dist
    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M

    from dataclasses import dataclass

    class Failing(M):
        @dataclass(kw_only=True, slots=True)
        class Config(M.Config):  # torchtitan: build() makes the class that declares Config
            pass

        @classmethod
        def _arm(cls, on: bool):
            cls.armed = on

        def storage_writer(self, checkpoint_id):  # the documented override point
            from fastckpt.dcp import FastCkptWriter
            from fastckpt.storage.io import PosixBackend

            class FailingBackend(PosixBackend):
                def pwrite(self, fd, data, offset):
                    raise OSError(28, "injected: no space left on device")

            armed = getattr(type(self), "armed", False) and dist.get_rank() == 1
            return FastCkptWriter(checkpoint_id, timeout_s=30,
                                  **({"io_backend": FailingBackend()} if armed else {}))

    Failing._arm(True)
    parts = _setup(0)
    _step(*parts, 0)
    mgr = _manager(Failing, folder, parts)
    err = None
    try:
        mgr.save(curr_step=1)
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = (type(e).__name__, str(e), sorted(getattr(e, "failures", {}) or {}))
    dist.barrier()
    root = os.path.join(folder, "checkpoint")
    committed_after_fail = fastckpt.is_committed(os.path.join(root, "step-1"))
    Failing._arm(False)
    ok = mgr.save(curr_step=2)
    dist.barrier()
    out = {"err": err, "committed_after_fail": committed_after_fail, "ok": ok,
           "committed_2": fastckpt.is_committed(os.path.join(root, "step-2"))}
    mgr.close()
    return out


def test_failing_rank_commits_nothing_and_raises_typed(pool, tmp_path):
    res = pool.run(rank_failure, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["err"] is not None, (r, out)
        assert out["err"][0] == "DistributedSaveError" and 1 in out["err"][2], (r, out["err"])
        assert "injected" in out["err"][1], out["err"]
        assert out["committed_after_fail"] is False, r
        assert out["ok"] and out["committed_2"], (r, out)


def rank_load_mismatch(folder: str) -> dict:
    """Loading a step into a model of another shape fails typed (an Exception, not DCP's BaseException)."""
    import torch.distributed as dist
    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M

    parts = _setup(0)
    _step(*parts, 0)
    mgr = _manager(M, folder, parts)
    mgr.save(curr_step=1)
    mgr.close()
    dist.barrier()
    other = _manager(M, folder, _setup(0, intermediate=48))
    try:
        other.load()
        out = {"type": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"type": type(e).__name__, "msg": str(e), "failures": sorted(getattr(e, "failures", {}) or {})}
    other.close()
    return out


def test_load_into_other_shapes_is_a_typed_error(pool, tmp_path):
    res = pool.run(rank_load_mismatch, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["type"] == "DCPLoadError" and out["failures"] == [0, 1], (r, out)
        assert "mlp" in out["msg"], out["msg"]


def rank_dtype_cast(folder: str, src: str, dst: str) -> dict:
    """Save a ``src`` model with the manager, load the step into a ``dst`` model: the values cast."""
    import torch.distributed as dist
    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M

    parts = _setup(0, dtype=getattr(torch, src))
    _step(*parts, 0)
    mgr = _manager(M, folder, parts)
    assert mgr.save(curr_step=1)
    mgr.maybe_wait_for_saving()
    saved = _full(parts[0].state_dict())
    mgr.close()
    dist.barrier()
    fresh = _setup(1, dtype=getattr(torch, dst))
    mgr2 = _manager(M, folder, fresh)
    assert mgr2.load() is True
    got = _full(fresh[0].state_dict())
    mgr2.close()
    return {"keys": sorted(saved), "dtypes": sorted({str(v.dtype) for v in got.values()}),
            "same": sorted(k for k in saved if k in got and _raw(got[k]) == _raw(saved[k].to(got[k].dtype)))}


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_load_into_other_dtype_casts_as_dcp(pool, tmp_path, src, dst):
    """The manager reads through FastCkptReader: a dtype difference is cast (as DCP's FileSystemReader
    does, ``target.copy_(stored)``), bit-exactly ``saved.to(dst)``, never the bytes reinterpreted."""
    res = pool.run(rank_dtype_cast, folder=str(tmp_path), src=src, dst=dst, timeout_s=TIMEOUT_S)
    for r, out in res.items():
        assert out["dtypes"] == [f"torch.{dst}"], (r, out["dtypes"])
        assert out["keys"] and out["same"] == out["keys"], (r, sorted(set(out["keys"]) - set(out["same"]))[:5])


class _Stream(torch.utils.data.IterableDataset):
    """A per-rank stream with a position (a stateful dataset, as torchtitan's HF datasets are)."""

    def __init__(self, rank: int):
        self.pos, self.rank = 0, rank

    def __iter__(self):
        while True:
            self.pos += 1
            yield torch.tensor([self.pos * 10 + self.rank])

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def rank_dataloader(folder: str, kind: str, async_mode: str) -> dict:
    """torchtitan's Trainer always hands the manager its ParallelAwareDataloader, whose state is a
    key per data-parallel rank (``dp_rank_<r>``); resume each rank's stream where it stopped."""
    import torch.distributed as dist
    from torchtitan.components.dataloader import ParallelAwareDataloader
    if kind == "stock":
        from torchtitan.components.checkpoint import CheckpointManager as M
    else:
        from fastckpt.integrations.torchtitan import FastCkptCheckpointManager as M
    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        parts = _setup(0)
        dl = ParallelAwareDataloader(_Stream(rank), dp_rank=rank, dp_world_size=world, batch_size=1)
        model, opt, sched, ts = parts
        mgr = M.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0, async_mode=async_mode).build(
            dataloader=dl, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={"train_state": ts},
            sd_adapter=None, base_folder=folder)
        return dl, mgr

    dl, mgr = build()
    it = iter(dl)
    for _ in range(3 + rank):  # the ranks stop at different positions
        next(it)
    assert mgr.save(curr_step=1)
    mgr.maybe_wait_for_saving()
    mgr.close()
    want = [int(next(it)) for _ in range(2)]
    dist.barrier()
    dl2, mgr2 = build()
    assert mgr2.load()
    mgr2.close()
    it2 = iter(dl2)
    return {"want": want, "got": [int(next(it2)) for _ in range(2)]}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_torchtitans_dataloader_resumes_each_ranks_stream(pool, tmp_path, async_mode):
    """The save raised DistributedSaveError on every rank ('ranks [1] planned a state whose keys ...
    differ'), so the manager did not drop into torchtitan.train (a torchtitan/DCP differential probe);
    now each rank resumes its own stream as with torchtitan's own manager, run beside it."""
    for kind in ("stock", "fast"):
        res = pool.run(rank_dataloader, folder=str(tmp_path / kind), kind=kind, async_mode=async_mode,
                       timeout_s=TIMEOUT_S)
        for r, out in res.items():
            assert out["got"] == out["want"] == [(4 + r) * 10 + r, (5 + r) * 10 + r], (kind, r, out)
