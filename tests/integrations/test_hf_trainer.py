"""Trainer callback: saving, rotation, failures, exact resume (C7), SIGKILL during save (C6).

Tiny random LlamaConfig models (attention dropout on, so RNG state matters), CPU, fp32.
The resumed runs execute in a fresh process (``python tests/integrations/test_hf_trainer.py ...``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.hf import trainer as hf_trainer
    from fastckpt.integrations.hf.models import tiny_llama
except ImportError:  # pyproject mapping not installed: import from the source tree
    sys.path.insert(0, str(REPO))
    from integrations.hf import trainer as hf_trainer
    from integrations.hf.models import tiny_llama

import fastckpt

transformers = pytest.importorskip("transformers")

N_ITEMS, BATCH, SEQ, VOCAB = 64, 4, 8, 128


class IntDataset(torch.utils.data.Dataset):
    """C7: 64 integers, each turned into a short token sequence (labels = inputs)."""

    def __len__(self):
        return N_ITEMS

    def __getitem__(self, i):
        ids = torch.tensor([(i * 7 + j * 13) % VOCAB for j in range(SEQ)])
        return {"input_ids": ids, "labels": ids.clone()}


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def tiny_tokenizer():
    """A word-level fast tokenizer over the 128 ids of the tiny models (built with ``tokenizers``)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "[PAD]": 1, "<s>": 2, "</s>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                                                bos_token="<s>", eos_token="</s>")


def make_trainer(out, *, peft=False, callbacks=(), mixin=True, processing_class=None, **args):
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(seed=0)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.1, task_type="CAUSAL_LM"))
    defaults = dict(output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=2,
                    seed=1234, data_seed=1234, learning_rate=1e-2, logging_steps=1,
                    save_strategy="steps", save_steps=19, report_to="none", use_cpu=True,
                    disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="linear",
                    warmup_steps=3)
    defaults.update(args)
    cls = type("T", (hf_trainer.FastCkptTrainerMixin, Trainer), {}) if mixin else Trainer
    evalset = IntDataset() if defaults.get("eval_strategy", "no") != "no" else None
    return cls(model=model, args=TrainingArguments(**defaults), train_dataset=IntDataset(),
               eval_dataset=evalset, callbacks=list(callbacks), processing_class=processing_class)


def losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def run_fresh(*argv, env_extra=None, check=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, __file__, *map(str, argv)], env=env, capture_output=True,
                       text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"child failed rc={p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}")
    return p


def test_callback_takes_over_saving(tmp_path):
    cb = hf_trainer.FastCkptCallback()
    tr = make_trainer(tmp_path, callbacks=[cb], save_steps=8, num_train_epochs=1)
    tr.train()
    ckpts = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert ckpts == ["checkpoint-16", "checkpoint-8"]
    for name in ckpts:
        d = tmp_path / name
        assert fastckpt.is_committed(d)
        names = {p.name for p in d.iterdir()}
        # the Trainer's own pickle files never appear
        assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}
        assert {"config.json", "trainer_state.json", "model.safetensors"} <= names  # one shard: no index
    assert [r["step"] for r in cb.records] == [8, 16]
    assert [fastckpt.read_manifest(tmp_path / f"checkpoint-{n}").step for n in (8, 16)] == [8, 16]
    assert all(r["bytes"] > 0 and r["blocking_s"] >= 0 for r in cb.records)
    assert not any(k.startswith("fastckpt") for h in tr.state.log_history for k in h)  # timings: records only
    st = json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())
    assert st["global_step"] == 8
    # saved after the Trainer logged step 8, as its own save is: the step's log entry is kept
    assert [h["step"] for h in st["log_history"] if "loss" in h] == list(range(1, 9))
    # the folder is an HF model folder with the live weights of step 16
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-16")
    live = tr.model.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(v, live[k]), k
    snap = fastckpt.load(tmp_path / "checkpoint-16")
    assert snap["trainer"]["global_step"] == 16
    assert set(snap["optimizer"]["state"]) == set(range(len(list(tr.model.parameters()))))


def test_peft_checkpoint_is_loadable(tmp_path):
    from peft import PeftModel

    tr = make_trainer(tmp_path, peft=True, save_steps=16, num_train_epochs=1)
    tr.train()
    d = tmp_path / "checkpoint-16"
    assert (d / "adapter_model.safetensors").is_file() and (d / "adapter_config.json").is_file()
    snap = fastckpt.load(d)
    ref = tiny_llama(seed=0).state_dict()
    ref.pop("lm_head.weight", None) if "lm_head.weight" not in snap["model"] else None
    assert set(snap["model"]) == set(ref)  # base weights under plain HF names
    for k, v in ref.items():
        assert torch.equal(snap["model"][k], v), k  # LoRA leaves the base untouched
    pm = PeftModel.from_pretrained(tiny_llama(seed=0), d).eval()
    auto = transformers.AutoModelForCausalLM.from_pretrained(d).eval()  # base + adapter
    tr.model.eval()
    x = IntDataset()[3]["input_ids"][None]
    with torch.no_grad():
        want = tr.model(x).logits
        assert torch.equal(pm(x).logits, want)
        assert torch.allclose(auto(x).logits, want, atol=1e-6)


@pytest.mark.parametrize("peft", [False, True])
def test_checkpoint_has_tokenizer_and_load_to_is_servable(tmp_path, capsys, peft):
    """The callback saves the Trainer's tokenizer + generation config; `fastckpt load --to` keeps them."""
    from fastckpt.cli.main import main

    tok = tiny_tokenizer()
    cb = hf_trainer.FastCkptCallback()
    tr = make_trainer(tmp_path / "run", peft=peft, callbacks=[cb], processing_class=tok, save_steps=8,
                      num_train_epochs=1)
    tr.train()
    for name in ("checkpoint-8", "checkpoint-16"):
        names = {p.name for p in (tmp_path / "run" / name).iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names, names
    assert all(r["total_s"] >= r["blocking_s"] for r in cb.records)
    out = tmp_path / "serve"
    assert main(["load", str(tmp_path / "run"), "--to", str(out), "-q"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert (out / "generation_config.json").is_file()
    got = transformers.AutoTokenizer.from_pretrained(out)
    assert got("w5 w9 w77")["input_ids"] == tok("w5 w9 w77")["input_ids"] == [5, 9, 77]
    transformers.GenerationConfig.from_pretrained(out)
    # an existing --to without --overwrite: one-line error, exit 2, no traceback
    assert main(["load", str(tmp_path / "run"), "--to", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--overwrite" in err and "Traceback" not in err


def test_save_total_limit_and_best_kept(tmp_path):
    tr = make_trainer(tmp_path, save_steps=4, num_train_epochs=1, save_total_limit=2,
                      eval_strategy="steps", eval_steps=4, metric_for_best_model="loss",
                      greater_is_better=True)  # makes step 4 the best (loss falls)
    tr.train()
    names = sorted((p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")),
                   key=lambda n: int(n.split("-")[1]))
    assert tr.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert names == ["checkpoint-4", "checkpoint-16"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_save_strategy_best_and_save_only_model(tmp_path):
    tr = make_trainer(tmp_path, num_train_epochs=1, save_strategy="best", eval_strategy="steps",
                      eval_steps=4, metric_for_best_model="loss", greater_is_better=False,
                      save_only_model=True)
    tr.train()
    steps = sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert steps and steps[-1] == tr.state.best_global_step
    snap = fastckpt.load(tmp_path / f"checkpoint-{steps[-1]}")
    assert "optimizer" not in snap and "rng" not in snap


def test_unknown_save_option_refused_at_construction():
    with pytest.raises(TypeError, match="thread"):
        hf_trainer.FastCkptCallback(thread=4)  # a typo of threads, caught before training starts
    hf_trainer.FastCkptCallback(threads=4, link_unchanged=False, staging_bytes=1 << 26)
    for own in ({"step": 5}, {"link_from": "x"}, {"weights": {}}):  # the callback sets these itself
        with pytest.raises(TypeError, match="set by the callback"):
            hf_trainer.FastCkptCallback(**own)
    with pytest.raises(ValueError, match="link_check"):
        hf_trainer.FastCkptCallback(link_check="nope")
    with pytest.raises(ValueError, match="threads"):
        hf_trainer.FastCkptCallback(threads=0)


def test_push_to_hub_refused(tmp_path):
    tr = make_trainer(tmp_path, num_train_epochs=1)
    tr.args.push_to_hub = True
    with pytest.raises(ValueError, match="push_to_hub"):
        tr.train()


def test_background_failure_surfaces(tmp_path, monkeypatch):
    class Boom(OSError):
        pass

    real = fastckpt.Saver.async_save  # the callback saves through its own Saver

    def failing(self, state, path, **kw):
        fut = real(self, state, Path(path).parent / ".never" / "x", **kw)  # keeps the future API
        fut.result()

        class F:
            def result(self, timeout_s=None):
                raise Boom(5, "injected EIO")

            def done(self):
                return True

            def wait_staged(self, timeout_s=None):
                return True
        return F()

    monkeypatch.setattr(fastckpt.Saver, "async_save", failing)
    tr = make_trainer(tmp_path, save_steps=4, num_train_epochs=1)
    with pytest.raises(Boom):
        tr.train()
    assert not list(tmp_path.glob("checkpoint-*"))


class WriteThroughData(transformers.TrainerCallback):
    """At one step, change a frozen base weight through ``.data`` (no version bump), as peft's
    ``merge_adapter``/``unmerge_adapter`` do."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == self.step:
            model.get_base_model().model.norm.weight.data.add_(1.0)


@pytest.mark.parametrize("write_at", [10, 4])
def test_frozen_weight_changed_behind_the_version_counter(tmp_path, caplog, write_at):
    """Caught before any commit: at step 16 by the background re-hash of the weights linked from
    checkpoint-8; at step 8 (the first save, nothing to link) by the hash check of the background
    copy (``defer_frozen``) against the hash taken at train begin. That save is dropped with a
    warning, never committed with stale bytes; the final save holds the live weight."""
    caplog.set_level("WARNING", logger="fastckpt.integrations.hf.trainer")
    tr = make_trainer(tmp_path, peft=True, callbacks=[WriteThroughData(write_at)], save_steps=8, num_train_epochs=1)
    before = tr.model.get_base_model().model.norm.weight.detach().clone()
    tr.train()
    cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, hf_trainer.FastCkptCallback))
    dropped = 16 if write_at > 8 else 8
    assert [f["step"] for f in cb.failed_saves] == [dropped] and "model.norm.weight" in cb.failed_saves[0]["error"]
    assert f"checkpoint-{dropped} was not committed" in caplog.text
    assert [r["step"] for r in cb.records] == ([8, 16] if dropped == 16 else [16])
    live = tr.model.get_base_model().model.norm.weight.detach()
    assert torch.equal(live, before + 1.0)
    assert torch.equal(fastckpt.load(tmp_path / "checkpoint-16")["model"]["model.norm.weight"], live)
    if dropped == 16:
        assert torch.equal(fastckpt.load(tmp_path / "checkpoint-8")["model"]["model.norm.weight"], before)
    else:
        assert not (tmp_path / "checkpoint-8").exists()
    assert fastckpt.verify(tmp_path / "checkpoint-16").ok


def test_get_last_checkpoint_skips_uncommitted(tmp_path, caplog):
    tr = make_trainer(tmp_path, save_steps=8, num_train_epochs=1)
    tr.train()
    fake = tmp_path / "checkpoint-99"  # a crashed plain-Trainer save: no manifest
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"\0" * 10)
    with caplog.at_level("INFO"):
        assert hf_trainer.get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-16")
    assert "checkpoint-99" in caplog.text
    assert hf_trainer.get_last_checkpoint(tmp_path / "nothing") is None


@pytest.mark.parametrize("peft", [False, True])
def test_exact_resume_fresh_process_C7(tmp_path, peft):
    """Checkpoint after 3 batches of the 2nd epoch (step 19); resume in a fresh process."""
    full = make_trainer(tmp_path / "a", peft=peft)
    full.train()
    ref = losses(full)
    assert len(ref) == 32
    out = json.loads(run_fresh("resume", tmp_path / "a" / "checkpoint-19", tmp_path / "b", int(peft)).stdout
                     .strip().splitlines()[-1])
    got = {int(k): v for k, v in out.items() if int(k) > 19}  # log_history 1..19 comes from the checkpoint
    assert sorted(got) == list(range(20, 33))
    for s in got:
        assert got[s] == ref[s], (s, got[s], ref[s])  # bit-exact on CPU


def test_resume_without_fastckpt_state_warns(tmp_path, caplog):
    tr = make_trainer(tmp_path / "a", num_train_epochs=1, save_steps=8, save_only_model=True)
    tr.train()
    tr2 = make_trainer(tmp_path / "a", num_train_epochs=1, save_steps=8)
    with caplog.at_level("WARNING"):
        tr2.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-8"))
    assert "resume is not exact" in caplog.text


def test_sigkill_during_save_then_resume_C6(tmp_path):
    """Step 8 committed; the process is SIGKILLed while step 16 is being written."""
    p = run_fresh("crash", tmp_path, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert fastckpt.is_committed(tmp_path / "checkpoint-8")
    assert not (tmp_path / "checkpoint-16").exists()  # the partial save stays hidden
    assert hf_trainer.get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-8")
    # resume=True picks step 8, and the continued run matches an uninterrupted one
    out = json.loads(run_fresh("resume", "auto", tmp_path, 0, 8).stdout.strip().splitlines()[-1])
    ref_tr = make_trainer(tmp_path / "ref", save_steps=8)
    ref_tr.train()
    ref = losses(ref_tr)
    assert {int(k): v for k, v in out.items() if int(k) > 8} == {s: ref[s] for s in range(9, 33)}


def _child(argv):
    mode = argv[0]
    if mode == "resume":
        ckpt, out, peft = argv[1], argv[2], bool(int(argv[3]))
        save_steps = int(argv[4]) if len(argv) > 4 else 19
        tr = make_trainer(out, peft=peft, save_steps=save_steps)
        tr.train(resume_from_checkpoint=True if ckpt == "auto" else ckpt)
        print(json.dumps(losses(tr)))
    elif mode == "crash":
        out = Path(argv[1])
        kill_during_save("checkpoint-16")
        make_trainer(out, save_steps=8).train()


def kill_during_save(name: str, after_files: int = 2) -> None:
    """SIGKILL this process while checkpoint ``name`` is being written: at the ``after_files``-th
    fsync of a file in its hidden temporary folder, or at the latest just before its commit rename."""
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    seen = []

    def fsync(fd):
        real_fsync(fd)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        parts = Path(target).parts
        if any(p.startswith(".") and name in p for p in parts[:-1]):
            seen.append(target)
            if len(seen) >= after_files:
                os.kill(os.getpid(), signal.SIGKILL)

    def guard(real):
        def fn(src, dst, *a, **k):
            if Path(dst).name == name:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *a, **k)
        return fn

    os.fsync, os.rename, os.replace = fsync, guard(real_rename), guard(real_replace)


if __name__ == "__main__":
    _child(sys.argv[1:])


def raw(t):
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _slow_background_copy(monkeypatch, seconds=0.4):
    """Delay the background staging copy of deferred tensors (defer_params)."""
    from fastckpt.saving import job as save_job
    real = save_job.SaveJob._stage_deferred
    monkeypatch.setattr(save_job.SaveJob, "_stage_deferred", lambda job: (time.sleep(seconds), real(job))[1])


class AtStepBegin(transformers.TrainerCallback):
    """Run ``fn(model, optimizer)`` at the start of step ``step + 1`` (after the save of ``step``,
    before the next optimizer step)."""

    def __init__(self, step, fn):
        self.step, self.fn, self.out = step, fn, None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == self.step:
            self.out = self.fn(model, optimizer)


def test_defer_params_optimizer_waits_for_the_background_copy(tmp_path, monkeypatch):
    """The save call does not copy parameters and optimizer state; the next optimizer step waits
    until the writer thread has, and the checkpoint holds exactly the state at the save."""
    _slow_background_copy(monkeypatch, seconds=1.5)  # > 0.2 s of wait even when the next step starts late (load)

    def grab(model, optimizer):
        opt = optimizer.state_dict()["state"]
        return ({k: v.detach().clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()})
    spy = AtStepBegin(8, grab)
    tr = make_trainer(tmp_path, callbacks=[spy], save_steps=8, num_train_epochs=1)
    tr.train()
    cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, hf_trainer.FastCkptCallback))
    rec = next(r for r in cb.records if r["step"] == 8)
    assert rec["staging_wait_s"] > 0.2 and rec["blocking_s"] >= rec["staging_wait_s"]
    model_at_save, opt_at_save = spy.out
    got = fastckpt.load(tmp_path / "checkpoint-8")
    assert got["model"] and set(got["model"]) <= set(model_at_save)
    for k, v in got["model"].items():
        assert raw(v) == raw(model_at_save[k]), k
    assert not torch.equal(got["model"]["lm_head.weight"], tr.model.lm_head.weight.detach())  # it trained on
    for i, s in opt_at_save.items():
        for k, v in s.items():
            assert raw(got["optimizer"]["state"][i][k]) == raw(v), (i, k)


def test_defer_params_write_before_the_copy_drops_that_save(tmp_path, monkeypatch, caplog):
    caplog.set_level("WARNING", logger="fastckpt.integrations.hf.trainer")
    _slow_background_copy(monkeypatch)

    def write(model, optimizer):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)  # a write outside the optimizer, before the copy
    tr = make_trainer(tmp_path, callbacks=[AtStepBegin(8, write)], save_steps=8, num_train_epochs=1)
    tr.train()
    cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, hf_trainer.FastCkptCallback))
    assert [f["step"] for f in cb.failed_saves] == [8] and "lm_head.weight" in cb.failed_saves[0]["error"]
    assert "checkpoint-8 was not committed" in caplog.text and "defer_params off" in caplog.text
    assert not (tmp_path / "checkpoint-8").exists()
    assert [r["step"] for r in cb.records] == [16] and cb.records[0]["staging_wait_s"] == 0
    assert raw(fastckpt.load(tmp_path / "checkpoint-16")["model"]["lm_head.weight"]) == raw(tr.model.lm_head.weight)


_DS_TRAINER = r"""
import os, sys, torch
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], ACCELERATE_USE_DEEPSPEED="true")
import deepspeed.comm.torch
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no C++ build on CPU
import transformers
from fastckpt.errors import UnsupportedTrainerOptionError
from fastckpt.integrations.hf.trainer import FastCkptCallback
class DS(torch.utils.data.Dataset):
    def __len__(self): return 8
    def __getitem__(self, i):
        x = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i)); return {"input_ids": x, "labels": x}
args = transformers.TrainingArguments(output_dir=sys.argv[1], max_steps=2, save_steps=1, per_device_train_batch_size=2,
    report_to="none", use_cpu=True, ddp_backend="gloo", disable_tqdm=True, optim="adamw_torch",
    deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
               "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9})
cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
t = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_config(cfg), args=args, train_dataset=DS(),
                         callbacks=[FastCkptCallback()])
try:
    t.train()
except UnsupportedTrainerOptionError as e:
    print("REFUSED", t.state.global_step, e)
"""


def test_deepspeed_trainer_is_refused_at_train_begin(tmp_path):
    """A DeepSpeed Trainer run with the callback died at the first step (AttributeError from the step
    gate on DeepSpeed's optimizer wrapper) or at the first save (a LossScaler in the state); now a typed
    refusal before any step, naming what to do (a multi-rank probe; ZeRO-2 in one process here)."""
    pytest.importorskip("deepspeed")
    script = tmp_path / "ds_trainer.py"
    script.write_text(_DS_TRAINER)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), "29631"], capture_output=True, text=True,
                       timeout=300)
    assert "REFUSED 0" in p.stdout and "Remove the callback" in p.stdout, (p.stdout[-2000:], p.stderr[-3000:])


def test_last_checkpoint_takes_a_newer_one_the_trainer_wrote_itself(tmp_path, caplog):
    """output_dir with fastckpt's checkpoint-16 and a newer checkpoint-50 the Trainer wrote by itself
    (a run before the callback was added): resume_from_checkpoint=True through the mixin skipped it,
    re-trained from step 16 and failed at the step-50 save (a Trainer differential probe). It is taken,
    as the Trainer's own get_last_checkpoint takes it; a crashed save (no trainer_state.json) is skipped."""
    tr = make_trainer(tmp_path, save_steps=8, num_train_epochs=1)
    tr.train()
    theirs = tmp_path / "checkpoint-50"
    theirs.mkdir()
    (theirs / "trainer_state.json").write_text("{}")
    crashed = tmp_path / "checkpoint-99"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"\0" * 10)
    with caplog.at_level("INFO"):
        assert hf_trainer.get_last_checkpoint(tmp_path) == str(theirs)
    assert "checkpoint-99" in caplog.text


def test_a_fresh_run_over_another_writers_checkpoint_refuses_before_training(tmp_path):
    """A checkpoint-8 of the plain Trainer (an earlier run) in output_dir: a fresh run with the callback
    trained 8 steps, then its save raised CheckpointExistsError (fastckpt never writes into another
    writer's folder; the Trainer writes into it). It is refused at train begin, naming the folder."""
    theirs = tmp_path / "checkpoint-8"
    theirs.mkdir(parents=True)
    (theirs / "trainer_state.json").write_text("{}")
    (theirs / "optimizer.pt").write_bytes(b"x")
    tr = make_trainer(tmp_path, save_steps=8, num_train_epochs=1)
    with pytest.raises(fastckpt.CheckpointExistsError, match=r"checkpoint-8 is a checkpoint folder fastckpt did not "
                                                             r"write.*nothing was trained"):
        tr.train()
    assert tr.state.global_step == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8"]


def test_a_modules_extra_state_is_restored_on_resume(tmp_path):
    """A module's non-tensor get_extra_state() was saved by the callback (state.json) but not handed
    back on resume: the Trainer loads model.safetensors (tensors only), so the resumed run started from
    the initial extra state with no word (a Trainer differential probe)."""
    import shutil

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n = 0

        def get_extra_state(self):
            return {"n": self.n}

        def set_extra_state(self, s):
            self.n = s["n"]

    def counting(tr):
        tr.model.counter = Counter()
        tr.model.register_forward_pre_hook(lambda m, a: setattr(m.counter, "n", m.counter.n + m.training))
        return tr

    full = counting(make_trainer(tmp_path / "a", save_steps=4, max_steps=8))
    full.train()
    assert fastckpt.load(tmp_path / "a" / "checkpoint-4")["model"]["counter._extra_state"] == {"n": 4}
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    tr = counting(make_trainer(tmp_path / "b", save_steps=4, max_steps=8))
    tr.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    assert tr.model.counter.n == full.model.counter.n == 8


def test_best_model_checkpoint_is_spelled_as_the_trainer_spells_it(tmp_path, monkeypatch):
    """output_dir='./out': the Trainer records best_model_checkpoint './out/checkpoint-N'; the callback
    recorded 'out/checkpoint-N' (the same folder, another string; a Trainer differential probe)."""
    monkeypatch.chdir(tmp_path)
    tr = make_trainer("./out", save_steps=4, max_steps=4, eval_strategy="steps", eval_steps=4,
                      metric_for_best_model="loss")
    tr.train()
    assert tr.state.best_model_checkpoint == os.path.join("./out", "checkpoint-4")
