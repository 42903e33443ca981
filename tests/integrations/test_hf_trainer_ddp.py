"""The Trainer callback in multi-process training: the real transformers Trainer under DDP (2 spawned
ranks, gloo, CPU, as torchrun would start them) and FSDP2 ``fully_shard`` (2 ranks).

DDP: every rank takes part in each save (the model written once, each rank's RNG state its own),
resume from a path and from ``True`` is bit-exact with an uninterrupted 2-rank run, a failure on one
rank fails every rank and commits nothing, and resuming at another world size restores what it can
and warns about the rest. Each rank seeds its torch RNG differently at train begin (attention
dropout on), so a rank restored with another rank's RNG state would train to other weights.

FSDP2: accelerate enables FSDP only on accelerator devices (``AcceleratorState`` turns an
``fsdp_plugin`` into ``DistributedType.FSDP`` only for ``MULTI_GPU``/``MULTI_NPU``/... types, never
``MULTI_CPU``), so the Trainer cannot run FSDP here: the test shards a tiny Llama with
``fully_shard`` and drives the callback events the Trainer would call (see docs/TRAINER.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "saving"))

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402

WORLD = 2
STEPS = 16  # 64 items / (4 per device * 2 ranks) = 8 steps per epoch, 2 epochs
TIMEOUT = 150.0


# ------------------------------------------------------------------------------------------------
# rank functions (run in the pool's spawned processes)
# ------------------------------------------------------------------------------------------------
def _torchrun_env() -> int:
    """Set what torchrun sets; the pool already joined the gloo group (accelerate reuses it)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    return rank


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rank_seed_callback():
    class RankSeed(transformers.TrainerCallback):
        """Each rank's own torch RNG stream (a fresh run only; a resumed run restores it)."""

        def on_train_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                torch.manual_seed(1000 + args.process_index)
    return RankSeed()


def ddp_train(out: str, resume=None, fail_rank: int | None = None, fail: str = "", **over) -> dict:
    """One rank of a DDP Trainer run with ``FastCkptCallback``; returns what the test compares."""
    rank = _torchrun_env()
    from test_hf_trainer import hf_trainer, make_trainer

    log = logging.getLogger("fastckpt.integrations.hf.trainer")
    h = _Warnings()
    log.addHandler(h)
    undo = []
    try:
        if rank == fail_rank and fail == "collect":  # a value the saver refuses, on this rank only
            undo.append((hf_trainer, "capture_rng_state", hf_trainer.capture_rng_state))
            hf_trainer.capture_rng_state = lambda: {"python": object()}
        if rank == fail_rank and fail == "write":  # an I/O error in this rank's background writes
            from fastckpt.saving import job

            def write_all(self):
                raise OSError(5, "injected EIO on rank %d" % rank)
            undo.append((job.SaveJob, "write_all", job.SaveJob.write_all))
            job.SaveJob.write_all = write_all
        args = {"ddp_backend": "gloo", "save_steps": 5, "num_train_epochs": 2, **over}
        cb = hf_trainer.FastCkptCallback()
        tr = make_trainer(out, mixin=False, callbacks=[cb, _rank_seed_callback()], **args)
        assert tr.args.world_size == WORLD and tr.args.process_index == rank
        t0 = time.monotonic()
        try:
            tr.train(resume_from_checkpoint=resume)
        except BaseException as e:  # reported with its time: every rank must fail, and soon
            return {"error": f"{type(e).__name__}: {e}", "mro": [c.__name__ for c in type(e).__mro__],
                    "after_s": time.monotonic() - t0}
        return {"weights": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
                "log": tr.state.log_history, "records": cb.records, "warnings": h.lines,
                "rng_now": torch.get_rng_state()}
    finally:
        log.removeHandler(h)
        for obj, name, val in undo:
            setattr(obj, name, val)


# ------------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from ranks import RankPool

    p = RankPool(str(tmp_path_factory.mktemp("ddp-pool")), world_size=WORLD, start_timeout_s=TIMEOUT)
    yield p
    p.close()


def run_ok(pool, **kw) -> dict:
    from ranks import RankError

    res = pool.call(ddp_train, timeout_s=TIMEOUT, **kw)
    for r, v in res.items():
        assert not isinstance(v, RankError), f"rank {r}: {v}\n{v.traceback}"
        assert "error" not in v, f"rank {r}: {v}"
    return res


_VOLATILE = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
             "total_flos"}


def steady(log) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in _VOLATILE} for h in log]


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.fixture(scope="module")
def reference(pool, tmp_path_factory):
    """An uninterrupted 2-rank run saving at steps 5, 10, 15 and 16 (the last)."""
    out = tmp_path_factory.mktemp("ddp-ref")
    return out, run_ok(pool, out=str(out))


# ------------------------------------------------------------------------------------------------
# DDP
# ------------------------------------------------------------------------------------------------
def test_ddp_every_rank_saves_model_once_rng_per_rank(reference):
    out, res = reference
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-15", "checkpoint-16", "checkpoint-5"]
    assert_bit_equal(res[0]["weights"], res[1]["weights"])  # DDP kept the replicas equal
    assert [r["step"] for r in res[0]["records"]] == [r["step"] for r in res[1]["records"]] == [5, 10, 15, 16]
    ck = out / "checkpoint-10"
    assert fastckpt.is_committed(ck)
    assert not list(ck.glob("*.pt*")) and not list(ck.glob("*.bin"))  # nothing pickled
    man = fastckpt.read_manifest(ck)
    assert man.world_size == WORLD
    assert set(man.distributed.rank_local_keys) == {"rng", "epoch_rng"}
    # the model is written once: one HF weights file, bytes written by both ranks, readable by HF
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_files = sorted(p.name for p in ck.glob("model*.safetensors"))
    assert len(model_files) == 1, model_files
    assert all(v > 0 for v in man.distributed.bytes_by_rank.values())
    raw = load_file(ck / model_files[0])
    hf = AutoModelForCausalLM.from_pretrained(out / "checkpoint-16")  # the last save: the final weights
    assert set(raw) <= set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(v.view(torch.uint8), res[0]["weights"][k].view(torch.uint8)), k
    # per-rank RNG states: one per rank, and different (each rank its own stream)
    from fastckpt.integrations.hf.snapshot import capture_rng_state
    tmpl = lambda: {"rng": capture_rng_state()}  # noqa: E731
    got = [fastckpt.load_into(tmpl(), ck, strict=False, local_rank=r)["rng"]["cpu"] for r in range(WORLD)]
    assert not torch.equal(got[0], got[1])


def test_ddp_resume_from_path_is_bit_exact(pool, reference, tmp_path):
    out, ref = reference
    res = run_ok(pool, out=str(tmp_path), resume=str(out / "checkpoint-10"))
    for r in range(WORLD):
        assert_bit_equal(res[r]["weights"], ref[r]["weights"])
        assert steady(res[r]["log"]) == steady(ref[r]["log"])
        assert torch.equal(res[r]["rng_now"], ref[r]["rng_now"])
        assert not res[r]["warnings"], res[r]["warnings"]
    assert [r["step"] for r in res[0]["records"]] == [15, 16]


def test_ddp_resume_from_true_is_bit_exact(pool, reference, tmp_path):
    out, ref = reference
    shutil.copytree(out / "checkpoint-5", tmp_path / "checkpoint-5")  # mid-epoch 1
    res = run_ok(pool, out=str(tmp_path), resume=True)
    for r in range(WORLD):
        assert_bit_equal(res[r]["weights"], ref[r]["weights"])
        assert steady(res[r]["log"]) == steady(ref[r]["log"])
    assert [r["step"] for r in res[1]["records"]] == [10, 15, 16]


def _single_process_train(out, resume=None, **over):
    """The same Trainer in the pytest process (no process group): world size 1."""
    from test_hf_trainer import hf_trainer, make_trainer

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        assert k not in os.environ
    cb = hf_trainer.FastCkptCallback()
    tr = make_trainer(out, mixin=False, callbacks=[cb], **over)
    tr.train(resume_from_checkpoint=resume)
    return tr


def test_ddp_resume_on_one_rank_restores_rank0_and_warns(reference, tmp_path, caplog):
    out, _ = reference
    ck = out / "checkpoint-10"
    caplog.set_level(logging.WARNING, logger="fastckpt.integrations.hf.trainer")
    tr = _single_process_train(tmp_path, resume=str(ck), save_steps=5, num_train_epochs=2,
                               per_device_train_batch_size=8)  # same global batch
    msgs = [r.getMessage() for r in caplog.records if "RNG" in r.getMessage()]
    assert any("saved by 2 ranks, resumed on 1" in m and "[1]" in m for m in msgs), msgs
    # model, optimizer and scheduler restored: the resumed run starts from checkpoint-10's state
    snap = fastckpt.load(ck, keys=["optimizer", "scheduler"])
    assert tr.state.log_history[9]["step"] == 10
    assert tr.state.global_step == STEPS
    assert snap["scheduler"]["last_epoch"] == 10
    # rank 0's RNG restored: check it on a fresh callback resume without training further
    from fastckpt.integrations.hf.resume import TrainerResume
    from fastckpt.integrations.hf.snapshot import capture_rng_state

    opt = torch.optim.AdamW(tr.model.parameters())
    tr_res = TrainerResume()
    state = transformers.TrainerState(global_step=10)
    assert tr_res.restore(str(ck), tr.args, state, None, None)
    torch.manual_seed(0)
    tr_res.at_epoch_begin()
    tr_res.at_step_begin()
    rank0 = fastckpt.load_into({"rng": capture_rng_state()}, ck, strict=False, local_rank=0)["rng"]["cpu"]
    assert torch.equal(torch.get_rng_state(), rank0)
    del opt


def test_resume_on_two_ranks_from_one_rank_checkpoint_warns(pool, tmp_path):
    one = tmp_path / "one"
    _single_process_train(one, save_steps=5, num_train_epochs=1, per_device_train_batch_size=8)
    ck = one / "checkpoint-5"
    assert fastckpt.read_manifest(ck).world_size == 1
    res = run_ok(pool, out=str(tmp_path / "two"), resume=str(ck), num_train_epochs=1)
    assert not any("RNG" in m for m in res[0]["warnings"]), res[0]["warnings"]
    assert any("no RNG state for rank 1" in m for m in res[1]["warnings"]), res[1]["warnings"]
    assert_bit_equal(res[0]["weights"], res[1]["weights"])


@pytest.mark.parametrize("fail", ["collect", "write"])
def test_ddp_failure_on_one_rank_fails_every_rank_nothing_committed(pool, tmp_path, fail):
    res = pool.call(ddp_train, timeout_s=TIMEOUT, out=str(tmp_path), fail_rank=1, fail=fail)
    for r in range(WORLD):
        v = res[r]
        assert isinstance(v, dict) and "error" in v, f"rank {r}: {v}"
        assert "DistributedSaveError" in v["mro"], v
        assert "rank 1" in v["error"], v
        assert v["after_s"] < 90, v
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")]
    assert not list(tmp_path.glob(".*"))  # no temporary folder left


# ------------------------------------------------------------------------------------------------
# FSDP2: fully_shard + the callback events the Trainer calls (the Trainer refuses FSDP on CPU)
# ------------------------------------------------------------------------------------------------
def fsdp2_train(out: str, steps: int, save_steps: int, resume: str | None = None, start: int = 0,
                vocab: int = 128, hsdp: bool = False) -> dict:
    """One rank: a tiny Llama sharded with ``fully_shard`` (each decoder layer, then the root), AdamW and
    a LambdaLR, trained ``steps`` steps by hand; ``FastCkptCallback`` gets the events
    ``Trainer._inner_training_loop`` sends (train begin, step begin/end with ``should_save`` set as
    ``DefaultFlowCallback`` sets it, train end) with a ``TrainerState``/``TrainerControl`` built here."""
    rank = _torchrun_env()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from fastckpt.integrations.hf import trainer as hf_trainer
    from fastckpt.integrations.hf.models import tiny_llama

    model = tiny_llama(seed=0, vocab_size=vocab)
    mesh = (init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")) if hsdp  # HSDP: 2-D
            else init_device_mesh("cpu", (WORLD,)))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) and p.device_mesh.ndim == (2 if hsdp else 1) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 40)
    args = TrainingArguments(output_dir=out, save_strategy="steps", save_steps=save_steps, report_to="none",
                             use_cpu=True, ddp_backend="gloo", max_steps=steps, disable_tqdm=True)
    assert args.world_size == WORLD
    cb = hf_trainer.FastCkptCallback(resume_from=resume)
    state, control = TrainerState(max_steps=steps, global_step=start), TrainerControl()
    kw = {"model": model, "optimizer": opt, "lr_scheduler": sched}
    if resume is None:
        torch.manual_seed(1000 + rank)  # each rank its own dropout stream: restored per rank at resume
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    try:
        cb.on_train_begin(args, state, control, **kw)
    except Exception as e:  # the live model must be untouched
        same = all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())
        return {"error": f"{type(e).__name__}: {e}", "mro": [c.__name__ for c in type(e).__mro__], "untouched": same}
    cb.on_epoch_begin(args, state, control, **kw)
    for step in range(start, steps):
        cb.on_step_begin(args, state, control, **kw)
        ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(100 * step + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        state.global_step, state.epoch = step + 1, (step + 1) / steps
        control.should_save = state.global_step % save_steps == 0 or state.global_step == steps
        cb.on_step_end(args, state, control, **kw)
    cb.on_train_end(args, state, control, **kw)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    osd = get_optimizer_state_dict(model, opt)
    moments = {k: v["exp_avg"].full_tensor().clone() for k, v in osd["state"].items()}
    return {"weights": full, "moments": moments, "records": cb.records, "lr": sched.get_last_lr(),
            "rng_now": torch.get_rng_state()}


def test_fsdp2_callback_saves_one_hf_folder_and_resumes_bit_exact(pool, tmp_path):
    from ranks import RankError

    def ok(res):
        for r, v in res.items():
            assert not isinstance(v, RankError), f"rank {r}: {v}\n{v.traceback}"
        return res

    ref = ok(pool.call(fsdp2_train, timeout_s=TIMEOUT, out=str(tmp_path / "ref"), steps=6, save_steps=3))
    ck = tmp_path / "ref" / "checkpoint-3"
    rows = fastckpt.load(ck, keys=["rng_by_rank"])["rng_by_rank"]  # one packed RNG state per rank
    assert rows.dtype == torch.uint8 and rows.shape[0] == WORLD and not torch.equal(rows[0], rows[1])
    assert fastckpt.is_committed(ck) and fastckpt.is_committed(tmp_path / "ref" / "checkpoint-6")
    assert [r["step"] for r in ref[0]["records"]] == [r["step"] for r in ref[1]["records"]] == [3, 6]
    # one HF folder of full tensors: transformers reads it (the step-6 weights of the live model)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref" / "checkpoint-6")
    for k, v in hf.state_dict().items():
        assert torch.equal(v.view(torch.uint8), ref[0]["weights"][k].view(torch.uint8)), k
    # resume 2 -> 2 from step 3: model and optimizer filled in place by load_into, bit-exact at step 6
    res = ok(pool.call(fsdp2_train, timeout_s=TIMEOUT, out=str(tmp_path / "res"), steps=6, save_steps=3,
                       resume=str(ck), start=3))
    for r in range(WORLD):
        assert_bit_equal(res[r]["weights"], ref[r]["weights"])
        assert res[r]["moments"].keys() == ref[r]["moments"].keys()
        for k in ref[r]["moments"]:
            assert torch.equal(res[r]["moments"][k], ref[r]["moments"][k]), k
        assert res[r]["lr"] == ref[r]["lr"]
        assert torch.equal(res[r]["rng_now"], ref[r]["rng_now"])
    # a model of another shape (vocabulary 256): StateMismatchError on both ranks, nothing written
    bad = ok(pool.call(fsdp2_train, timeout_s=TIMEOUT, out=str(tmp_path / "bad"), steps=6, save_steps=3,
                       resume=str(ck), start=3, vocab=256))
    for r in range(WORLD):
        assert "StateMismatchError" in bad[r]["mro"] and "model.embed_tokens.weight" in bad[r]["error"], bad[r]
        assert bad[r]["untouched"]


def test_pack_rng_round_trip_restores_every_generator():
    import random

    import numpy as np

    from fastckpt.integrations.hf.rank_state import pack_rng, unpack_rng
    from fastckpt.integrations.hf.snapshot import capture_rng_state, restore_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in NumPy's state
    rng = capture_rng_state()
    rng["cuda"] = [torch.arange(16, dtype=torch.uint8), torch.arange(16, dtype=torch.uint8) + 1]  # layout only
    row = pack_rng(rng)
    back = unpack_rng(row.clone())
    assert torch.equal(back["cpu"], rng["cpu"]) and all(torch.equal(a, b) for a, b in zip(back["cuda"], rng["cuda"]))
    want = (random.random(), np.random.standard_normal(), torch.rand(3))
    back.pop("cuda")
    restore_rng_state(back)
    assert (random.random(), np.random.standard_normal()) == want[:2] and torch.equal(torch.rand(3), want[2])


def test_fsdp2_on_a_2d_mesh_resumes_bit_exact(pool, tmp_path):
    """HSDP (a 2-D mesh: replicate x shard): the RNG rows live on a flat mesh over the same ranks."""
    from ranks import RankError

    def ok(res):
        for r, v in res.items():
            assert not isinstance(v, RankError), f"rank {r}: {v}\n{v.traceback}"
        return res

    ref = ok(pool.call(fsdp2_train, timeout_s=TIMEOUT, out=str(tmp_path / "ref"), steps=4, save_steps=2, hsdp=True))
    ck = tmp_path / "ref" / "checkpoint-2"
    rows = fastckpt.load(ck, keys=["rng_by_rank"])["rng_by_rank"]
    assert rows.shape[0] == WORLD and not torch.equal(rows[0], rows[1])
    res = ok(pool.call(fsdp2_train, timeout_s=TIMEOUT, out=str(tmp_path / "res"), steps=4, save_steps=2,
                       resume=str(ck), start=2, hsdp=True))
    for r in range(WORLD):
        assert_bit_equal(res[r]["weights"], ref[r]["weights"])
        for k in ref[r]["moments"]:
            assert torch.equal(res[r]["moments"][k], ref[r]["moments"][k]), k
        assert torch.equal(res[r]["rng_now"], ref[r]["rng_now"])
