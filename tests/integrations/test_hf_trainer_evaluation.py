"""The callback's saves on evaluation steps match the Trainer's own, run side by side (transformers'
``_maybe_log_save_evaluate`` is the specification): ``eval_on_start``, several eval datasets, and a
``ReduceLROnPlateau`` scheduler the Trainer steps right after ``on_evaluate``. Found by a differential
probe of the Trainer's checkpointing features; each case was silently different before (exit 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fastckpt

transformers = pytest.importorskip("transformers")
from fastckpt.integrations.hf.trainer import FastCkptCallback  # noqa: E402
from test_hf_trainer import StopAt  # noqa: E402


class Data(torch.utils.data.Dataset):
    def __init__(self, n, off=0):
        self.n, self.off = n, off

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.tensor([((i + self.off) * 7 + j * 13) % 128 for j in range(16)])
        return {"input_ids": ids, "labels": ids.clone()}


class Scores:
    """compute_metrics giving one fixed ``score`` per evaluation, in order."""

    def __init__(self, seq):
        self.seq, self.i = list(seq), 0

    def __call__(self, p):
        self.i += 1
        return {"score": self.seq[self.i - 1]}


def train(out, fast, *, eval_dataset=None, compute_metrics=None, callbacks=(), resume=None, **kw):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, eval_strategy="steps",
        eval_steps=2, save_steps=2, logging_steps=1, seed=1, report_to="none", use_cpu=True, disable_tqdm=True, **kw)
    t = transformers.Trainer(model=model, args=args, train_dataset=Data(32),
                             eval_dataset=eval_dataset if eval_dataset is not None else Data(8, 100),
                             compute_metrics=compute_metrics,
                             callbacks=([FastCkptCallback()] if fast else []) + list(callbacks))
    t.train(resume_from_checkpoint=resume)
    return t


def folders(out) -> list[str]:
    return sorted(p.name for p in Path(out).glob("checkpoint-*"))


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


@pytest.mark.parametrize("kw", [dict(save_strategy="best"),
                                dict(save_strategy="steps", load_best_model_at_end=True, save_total_limit=1)],
                         ids=["save_strategy_best", "load_best_model_at_end"])
def test_eval_on_start_does_not_count_for_the_best_checkpoint(tmp_path, kw):
    """The Trainer's eval_on_start evaluation decides nothing (no best metric, no save); the callback
    counted it: checkpoint-0 kept as the best instead of checkpoint-4, the final model not the best."""
    args = dict(max_steps=8, eval_on_start=True, metric_for_best_model="score", greater_is_better=True, **kw)
    seq = [0.99, 0.5, 0.9, 0.3, 0.2]  # step 0, 2, 4, 6, 8: best after start is step 4
    ref = train(tmp_path / "ref", False, compute_metrics=Scores(seq), **args)
    got = train(tmp_path / "fc", True, compute_metrics=Scores(seq), **args)
    assert folders(tmp_path / "fc") == folders(tmp_path / "ref") and "checkpoint-0" not in folders(tmp_path / "fc")
    assert (got.state.best_metric, got.state.best_global_step) == (ref.state.best_metric, ref.state.best_global_step)
    assert Path(got.state.best_model_checkpoint).name == Path(ref.state.best_model_checkpoint).name == "checkpoint-4"
    assert same_weights(got, ref)


def test_several_eval_datasets_decide_together(tmp_path):
    """eval_dataset={"a", "b"}: one on_evaluate per dataset. The callback acted on the first: with
    metric_for_best_model="b_loss" training died with KeyError; without, trainer_state.json lacked b's
    entries. Now the merged metrics of the last one decide, as the Trainer's."""
    evals = lambda: {"a": Data(8, 100), "b": Data(8, 200)}  # noqa: E731
    args = dict(max_steps=4, metric_for_best_model="b_loss", load_best_model_at_end=True)
    ref = train(tmp_path / "ref", False, eval_dataset=evals(), **args)
    got = train(tmp_path / "fc", True, eval_dataset=evals(), **args)
    assert folders(tmp_path / "fc") == folders(tmp_path / "ref")
    assert Path(got.state.best_model_checkpoint).name == Path(ref.state.best_model_checkpoint).name
    assert same_weights(got, ref)
    for d in folders(tmp_path / "ref"):
        want = json.loads((tmp_path / "ref" / d / "trainer_state.json").read_text())
        have = json.loads((tmp_path / "fc" / d / "trainer_state.json").read_text())
        keys = lambda s: sorted(k for e in s["log_history"] for k in e if k.endswith("_loss"))  # noqa: E731
        assert keys(have) == keys(want), d
        assert (have["best_metric"], have["best_global_step"]) == (want["best_metric"], want["best_global_step"])


def test_plateau_scheduler_is_saved_as_the_trainer_leaves_it(tmp_path):
    """ReduceLROnPlateau: the Trainer steps it right after on_evaluate, before saving; the callback
    saved it (and the optimizer's lr) from before that step, so a resume trained on with the old lr."""
    args = dict(max_steps=8, lr_scheduler_type="reduce_lr_on_plateau",
                lr_scheduler_kwargs={"patience": 0, "factor": 0.5})
    train(tmp_path / "ref", False, callbacks=[StopAt(4)], **args)
    train(tmp_path / "fc", True, callbacks=[StopAt(4)], **args)
    want = torch.load(tmp_path / "ref" / "checkpoint-4" / "scheduler.pt", weights_only=False)
    want_lr = torch.load(tmp_path / "ref" / "checkpoint-4" / "optimizer.pt", weights_only=False)["param_groups"][0]["lr"]
    have = fastckpt.load(tmp_path / "fc" / "checkpoint-4")
    for k in ("last_epoch", "best", "num_bad_epochs", "_last_lr"):
        assert have["scheduler"][k] == want[k], k
    assert have["optimizer"]["param_groups"][0]["lr"] == want_lr
    a = train(tmp_path / "ref", False, resume=str(tmp_path / "ref" / "checkpoint-4"), **args)
    b = train(tmp_path / "fc", True, resume=str(tmp_path / "fc" / "checkpoint-4"), **args)
    loss = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert loss(b) == loss(a) and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert same_weights(a, b)


def test_best_global_step_only_where_the_trainer_sets_it(tmp_path):
    """save_strategy="no" with evaluation and metric_for_best_model: the Trainer sets best_metric and
    leaves best_global_step None (no checkpoint step); the callback set it."""
    args = dict(max_steps=4, save_strategy="no", metric_for_best_model="loss")
    ref = train(tmp_path / "ref", False, **args)
    got = train(tmp_path / "fc", True, **args)
    assert ref.state.best_global_step is None and ref.state.best_metric is not None
    assert (got.state.best_metric, got.state.best_global_step) == (ref.state.best_metric, ref.state.best_global_step)
    assert folders(tmp_path / "fc") == folders(tmp_path / "ref") == []
