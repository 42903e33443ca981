"""The Trainer callback keeps transformers' own contracts (issue 14), against the real Trainer 5.24.0.

The behaviours mirror upstream ``tests/trainer/test_trainer_callback.py`` (event order, ``on_save``
per checkpoint) and ``tests/trainer/test_trainer_checkpointing.py`` (``checkpoint-N`` naming,
``save_total_limit``, best model kept and loaded, ``save_only_model``, exact resume from a path and
from ``True``). Where possible a plain Trainer (its own pickle save) runs the same configuration and
the results are compared: folder names, best checkpoint, final weights bit for bit. Tiny Llama, fp32,
CPU, 16 steps per epoch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from test_hf_trainer import IntDataset, hf_trainer, losses, make_trainer

import fastckpt
from fastckpt.errors import (CheckpointNotFoundError, FastCkptError, ResumeMismatchError,
                             TrainerCheckpointNotFoundError)

transformers = pytest.importorskip("transformers")
Trainer = transformers.Trainer


def ckpt_names(out) -> list[str]:
    return sorted((p.name for p in Path(out).iterdir() if p.name.startswith("checkpoint-")),
                  key=lambda n: int(n.split("-")[1]))


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                           b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k


def fast(out, **kw):
    """Plain ``Trainer`` (no mixin) with only ``FastCkptCallback`` added."""
    cbs = list(kw.pop("callbacks", ()))
    return make_trainer(out, mixin=False, callbacks=[hf_trainer.FastCkptCallback(), *cbs], **kw)


def plain(out, **kw):
    """The same Trainer saving with its own code (the reference)."""
    return make_trainer(out, mixin=False, **kw)


_VOLATILE = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
             "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def steady(log_history) -> list[dict]:
    """log_history without wall-clock numbers (and the per-call mean train_loss)."""
    return [{k: v for k, v in h.items() if k not in _VOLATILE} for h in log_history]


# ------------------------------------------------------------------------------------------------
# on_save
# ------------------------------------------------------------------------------------------------
class Recorder(transformers.TrainerCallback):
    """Records every event: name, thread, the state's global_step and, for on_save, whether
    ``checkpoint-{global_step}`` is a committed folder; also which checkpoints are committed."""

    def __init__(self):
        self.events = []
        self.futures = []  # (step, SaveFuture) of each save, when watch() was called

    def watch(self, cb) -> None:
        """Record, at every event, which saves of ``cb`` (a FastCkptCallback) are finished: committed
        durably (renamed into place, parent folder fsynced) or failed."""
        real = cb._saver.async_save

        def async_save(state, path, **kw):
            fut = real(state, path, **kw)
            self.futures.append((kw.get("step"), fut))
            return fut
        cb._saver.async_save = async_save

    def _rec(self, name, args, state, **extra):
        # finished first, then visible: a save finishing between the two looks would otherwise be seen
        # finished before visible within one event (a race of the recorder, seen once in CI)
        done = {f"checkpoint-{step}" for step, fut in self.futures if fut.done()}
        committed = {p.name for p in Path(args.output_dir).glob("checkpoint-*") if fastckpt.is_committed(p)}
        self.events.append({"event": name, "thread": threading.get_ident(), "step": state.global_step,
                            "committed": committed, "done": done, "state_id": id(state), **extra})

    def on_save(self, args, state, control, **kw):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"  # what W&B & co. upload
        self._rec("on_save", args, state, folder_ok=folder.is_dir() and (folder / "trainer_state.json").is_file(),
                  has_model=kw.get("model") is not None)


for _ev in ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
            "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_epoch_end", "on_train_end"):
    setattr(Recorder, _ev, (lambda name: lambda self, args, state, control, **kw: self._rec(name, args, state))(_ev))


def test_on_save_fires_after_each_commit_on_the_training_thread(tmp_path):
    ref_rec = Recorder()
    plain(tmp_path / "plain", callbacks=[ref_rec], save_steps=4, num_train_epochs=1).train()
    rec = Recorder()
    tr = fast(tmp_path / "fast", callbacks=[rec], save_steps=4, num_train_epochs=1)
    rec.watch(next(c for c in tr.callback_handler.callbacks if isinstance(c, hf_trainer.FastCkptCallback)))
    tr.train()
    assert [step for step, _ in rec.futures] == [4, 8, 12, 16]
    saves = [e for e in rec.events if e["event"] == "on_save"]
    # one on_save per checkpoint, as the Trainer's own save: same steps
    assert [e["step"] for e in saves] == [e["step"] for e in ref_rec.events if e["event"] == "on_save"] \
        == [4, 8, 12, 16]
    main = threading.main_thread().ident
    live_state = tr.state
    for e in saves:
        i = rec.events.index(e)
        name = f"checkpoint-{e['step']}"
        assert e["thread"] == main
        assert e["folder_ok"] and e["has_model"] and name in e["committed"]
        assert e["state_id"] != id(live_state)  # a snapshot of the state as of the save step
        # not at the save call: the save of step N is made in on_log(N), before this callback's on_log(N)
        log_n = next(j for j, x in enumerate(rec.events) if x["event"] == "on_log" and x["step"] == e["step"])
        assert i > log_n
        # at the first event after the commit (the save finished: renamed and the parent folder fsynced; a
        # folder can be visible a while before that): no event of this recorder before the one in which
        # it fires saw the save finished, except the one right before (done between two callbacks)
        first_done = next(j for j, x in enumerate(rec.events) if name in x["done"])
        assert i - first_done <= 1, rec.events[first_done:i + 1]
        first_seen = next(j for j, x in enumerate(rec.events) if name in x["committed"])
        assert first_seen <= first_done  # visible no later than finished
    # the last save's on_save comes before train() returns and before this recorder's on_train_end
    assert rec.events.index(saves[-1]) < next(j for j, x in enumerate(rec.events) if x["event"] == "on_train_end")


class ReleaseAt(transformers.TrainerCallback):
    def __init__(self, step, event):
        self.step, self.event = step, event

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            self.event.set()


def test_on_save_sees_the_state_of_its_step_when_it_fires_later(tmp_path, monkeypatch):
    """The first save's background fsyncs are held until step 7 has ended, so its commit lands
    while later steps run: its on_save still gets a state with global_step 5."""
    release = threading.Event()
    real_fsync = os.fsync

    def held_fsync(fd):
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)  # bounded: a missed release slows the test, never hangs it
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", held_fsync)
    rec = Recorder()
    tr = fast(tmp_path, callbacks=[ReleaseAt(7, release), rec], save_steps=5, num_train_epochs=1)
    tr.train()
    saves = [e for e in rec.events if e["event"] == "on_save"]
    assert [e["step"] for e in saves] == [5, 10, 15, 16]  # the Trainer also saves at the last step
    first = rec.events.index(saves[0])
    assert max(x["step"] for x in rec.events[:first]) >= 7  # fired after later steps ran ...
    assert saves[0]["step"] == 5  # ... with the state as of its own step
    assert all(f"checkpoint-{e['step']}" in e["committed"] for e in saves)


class CommitInsideSaveEvent(transformers.TrainerCallback):
    """Placed before ``FastCkptCallback``: from the end of step ``hold_at`` the background fsyncs wait;
    at ``event`` of step ``release_at`` this callback lets them go and waits until the save in flight is
    finished. The fastckpt callback then first sees that commit inside the very event in which the
    Trainer asks for the next save, and fires the earlier save's ``on_save`` there."""

    def __init__(self, cb, hold_at: int, release_at: int, event: str):
        self.cb, self.hold_at, self.release_at, self.event = cb, hold_at, release_at, event
        self.hold, self.release = threading.Event(), threading.Event()
        self.caught = None  # True if the held save was still in flight at release_at

    def fsync(self, real):
        def held_fsync(fd):
            if self.hold.is_set() and threading.current_thread() is not threading.main_thread():
                self.release.wait(30)  # bounded: a missed release slows the test, never hangs it
            real(fd)
        return held_fsync

    def _finish_pending(self):
        pending = self.cb._pending
        deadline = time.monotonic() + 30
        while pending is not None and not pending[0].done() and time.monotonic() < deadline:
            time.sleep(0.002)

    def _at(self, event, state):
        if event == "on_step_end" and state.global_step == self.hold_at:
            self._finish_pending()  # an earlier save still writing is not held: only the next one
            self.hold.set()
        if event == self.event and state.global_step == self.release_at:
            pending = self.cb._pending
            self.caught = pending is not None and not pending[0].done()
            self.release.set()
            self._finish_pending()

    def on_step_end(self, args, state, control, **kw):
        self._at("on_step_end", state)

    def on_epoch_end(self, args, state, control, **kw):
        self._at("on_epoch_end", state)


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_a_commit_seen_in_a_save_event_does_not_cancel_that_save(tmp_path, monkeypatch, strategy):
    """The Trainer's ``CallbackHandler.on_save`` sets ``control.should_save = False``. When the previous
    save's commit is first seen in the event where the Trainer asks for the next save (``on_step_end``
    of a save step, ``on_epoch_end``), firing its ``on_save`` there must not cancel that next save
    (CI run of stop 17: checkpoint-12 of 4/8/12/16 was never written, checkpoint-15 of 5/10/15/16)."""
    if strategy == "steps":
        kw, hold_at, release_at, event, steps = dict(save_steps=4, num_train_epochs=1), 8, 12, "on_step_end", \
            [4, 8, 12, 16]
    else:
        kw, hold_at, release_at, event, steps = dict(save_strategy="epoch", num_train_epochs=2), 16, 32, \
            "on_epoch_end", [16, 32]
    cb, rec = hf_trainer.FastCkptCallback(), Recorder()
    gate = CommitInsideSaveEvent(cb, hold_at, release_at, event)
    monkeypatch.setattr(os, "fsync", gate.fsync(os.fsync))
    rec.watch(cb)
    tr = make_trainer(tmp_path, mixin=False, callbacks=[gate, cb, rec], **kw)
    tr.train()
    assert gate.caught is True  # the race was set up: the held save was in flight until that event
    assert [step for step, _ in rec.futures] == steps
    assert [e["step"] for e in rec.events if e["event"] == "on_save"] == steps
    assert ckpt_names(tmp_path) == [f"checkpoint-{s}" for s in steps]
    assert all(fastckpt.is_committed(tmp_path / f"checkpoint-{s}") for s in steps)


# ------------------------------------------------------------------------------------------------
# exact resume without the mixin, log_history
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """Uninterrupted 32-step run (2 epochs) that also commits checkpoint-19 (mid-epoch 2)."""
    out = tmp_path_factory.mktemp("full")
    tr = fast(out, save_steps=19)
    tr.train()
    return out, weights(tr.model), list(tr.state.log_history), tr.lr_scheduler.get_last_lr()


@pytest.mark.parametrize("how", ["path", "true"])
def test_exact_resume_without_mixin_from_another_folder(tmp_path, full_run, how):
    src, ref_w, ref_log, ref_lr = full_run
    if how == "path":  # resume a run in a new output_dir from the other run's folder
        out, arg = tmp_path / "b", str(src / "checkpoint-19")
    else:  # resume_from_checkpoint=True: the Trainer's own get_last_checkpoint picks it
        out = tmp_path / "c"
        out.mkdir()
        shutil.copytree(src / "checkpoint-19", out / "checkpoint-19")
        arg = True
    tr = fast(out, save_steps=19)
    assert type(tr) is Trainer  # no mixin
    tr.train(resume_from_checkpoint=arg)
    assert tr.state.global_step == 32
    assert_bit_equal(weights(tr.model), ref_w)  # optimizer, scheduler and RNG (dropout) restored
    assert tr.lr_scheduler.get_last_lr() == ref_lr
    # log_history: the same entries as the uninterrupted run's (no fastckpt entries)
    assert steady(tr.state.log_history) == steady(ref_log)
    assert not any(k.startswith("fastckpt") for h in tr.state.log_history for k in h)


def test_resume_from_the_trainers_own_checkpoint_says_the_trainer_restored_it(tmp_path, full_run, caplog):
    """The callback resuming a checkpoint the Trainer wrote itself (its optimizer.pt, scheduler.pt,
    rng_state.pth): the Trainer restores those, the run equals the uninterrupted one, and the callback
    says so at INFO instead of warning that the resume may not be exact (a handoff probe saw the
    warning on an exact resume)."""
    _, ref_w, _, ref_lr = full_run
    native = plain(tmp_path / "native", save_steps=19)
    native.train()
    assert (tmp_path / "native" / "checkpoint-19" / "optimizer.pt").is_file()
    tr = fast(tmp_path / "e", save_steps=19)
    with caplog.at_level(logging.INFO):
        tr.train(resume_from_checkpoint=str(tmp_path / "native" / "checkpoint-19"))
    assert "not a committed fastckpt checkpoint" not in caplog.text
    assert "restored by the Trainer from optimizer.pt" in caplog.text, caplog.text
    assert_bit_equal(weights(tr.model), ref_w)
    assert tr.lr_scheduler.get_last_lr() == ref_lr


def test_resume_without_restore_differs(tmp_path, full_run, caplog):
    """Control: the same resume with the callback pointed at a folder it cannot restore from
    (optimizer, scheduler and RNG then start fresh) does not give the uninterrupted run's weights,
    so the test above can fail."""
    src, ref_w, _, _ = full_run
    cb = hf_trainer.FastCkptCallback(resume_from=str(tmp_path / "not-a-checkpoint"))
    tr = make_trainer(tmp_path / "d", mixin=False, callbacks=[cb], save_steps=19)
    with caplog.at_level(logging.WARNING):
        tr.train(resume_from_checkpoint=str(src / "checkpoint-19"))
    assert "not a committed fastckpt checkpoint" in caplog.text
    assert any(not torch.equal(a, b) for a, b in zip(weights(tr.model).values(), ref_w.values()))


# ------------------------------------------------------------------------------------------------
# a save on an evaluation step
# ------------------------------------------------------------------------------------------------
class EvalWithoutEvent(Trainer):
    """Overrides evaluation and never calls ``on_evaluate`` (as some subclasses do)."""

    def evaluate(self, *args, **kwargs):
        return {"eval_loss": 1.0 / (1 + self.state.global_step)}


def trainer_saved_weights(folder) -> dict[str, torch.Tensor]:
    """The weights a plain Trainer saved in ``folder`` (its own ``model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.mark.parametrize("on_evaluate", [True, False])
def test_save_on_an_eval_step_is_written(tmp_path, caplog, on_evaluate):
    """save_steps == eval_steps: a checkpoint at every eval step, holding the weights the plain
    Trainer saves there, whether or not ``on_evaluate`` ever fires."""
    cls = Trainer if on_evaluate else EvalWithoutEvent
    args = dict(save_steps=4, num_train_epochs=1, eval_strategy="steps", eval_steps=4)

    def build(out, callbacks):
        base = make_trainer(out, mixin=False, **args)
        return cls(model=base.model, args=base.args, train_dataset=IntDataset(), eval_dataset=IntDataset(),
                   callbacks=callbacks)

    build(tmp_path / "plain", []).train()
    tr = build(tmp_path / "e", [hf_trainer.FastCkptCallback()])
    with caplog.at_level(logging.WARNING, logger="fastckpt.integrations.hf.trainer"):
        tr.train()
    names = ["checkpoint-4", "checkpoint-8", "checkpoint-12", "checkpoint-16"]
    assert ckpt_names(tmp_path / "e") == ckpt_names(tmp_path / "plain") == names
    assert ("on_evaluate never came" in caplog.text) is (not on_evaluate)
    for n in (4, 8, 12, 16):
        d = tmp_path / "e" / f"checkpoint-{n}"
        assert fastckpt.is_committed(d) and fastckpt.read_manifest(d).step == n
        # the weights of step n, as the Trainer saved them (not of n+1: the save at the next event
        # runs before the next update)
        got = fastckpt.load(d)["model"]
        want = trainer_saved_weights(tmp_path / "plain" / f"checkpoint-{n}")
        assert want.keys() <= got.keys()
        assert_bit_equal({k: got[k] for k in want}, want)


def test_epoch_save_without_on_evaluate_resumes_exactly(tmp_path):
    """save and eval at each epoch end, evaluate() never calls on_evaluate: the save comes at the
    next epoch's begin, before the sampler draws that epoch's shuffle, so resuming from it is exact."""
    def build(out):
        base = make_trainer(out, mixin=False, save_strategy="epoch", eval_strategy="epoch", num_train_epochs=2)
        return EvalWithoutEvent(model=base.model, args=base.args, train_dataset=IntDataset(),
                                eval_dataset=IntDataset(), callbacks=[hf_trainer.FastCkptCallback()])

    full = build(tmp_path / "a")
    full.train()
    assert ckpt_names(tmp_path / "a") == ["checkpoint-16", "checkpoint-32"]
    again = build(tmp_path / "b")
    again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-16"))
    assert losses(again) == losses(full)
    assert_bit_equal(weights(again.model), weights(full.model))


# ------------------------------------------------------------------------------------------------
# exception types
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["empty", "missing"])
def test_resume_true_without_checkpoint_raises_a_value_error_like_the_trainer(tmp_path, folder):
    """The mixin resolves ``resume_from_checkpoint=True`` itself: with nothing to resume it raises what
    the Trainer raises, same type (a ValueError) and the same message, for the same output_dir."""
    out = tmp_path / "o"
    if folder == "empty":
        out.mkdir()
    with pytest.raises(Exception) as ref:  # the Trainer's own, in the same output_dir
        plain(out).train(resume_from_checkpoint=True)
    shutil.rmtree(out, ignore_errors=True)
    if folder == "empty":
        out.mkdir()
    with pytest.raises(Exception) as ei:
        make_trainer(out).train(resume_from_checkpoint=True)
    assert isinstance(ei.value, type(ref.value)) and type(ref.value) is ValueError
    assert str(ei.value) == str(ref.value) == f"No valid checkpoint found in output directory ({out})"
    assert isinstance(ei.value, TrainerCheckpointNotFoundError) and isinstance(ei.value, CheckpointNotFoundError)


def test_push_to_hub_and_step_mismatch_are_value_errors(tmp_path):
    tr = fast(tmp_path / "a", max_steps=2, save_steps=2)
    tr.args.push_to_hub = True
    with pytest.raises(ValueError) as ei:
        tr.train()
    assert isinstance(ei.value, FastCkptError) and "push_to_hub" in str(ei.value)
    fast(tmp_path / "b", max_steps=4, save_steps=2).train()
    ck = tmp_path / "b" / "checkpoint-2"
    st = (ck / "trainer_state.json").read_text().replace('"global_step": 2', '"global_step": 3')
    (ck / "trainer_state.json").write_text(st)  # edited: the Trainer resumes at step 3
    with pytest.raises(ValueError) as ei:
        fast(tmp_path / "c", max_steps=4, save_steps=2).train(resume_from_checkpoint=str(ck))
    assert isinstance(ei.value, ResumeMismatchError) and "step 2" in str(ei.value) and "step 3" in str(ei.value)


# ------------------------------------------------------------------------------------------------
# rotation and resume with an earlier run's higher-numbered checkpoints in output_dir
# ------------------------------------------------------------------------------------------------
def foreign(out, step, mtime_offset_s):
    d = Path(out) / f"checkpoint-{step}"
    fastckpt.save({"w": torch.ones(4)}, d, step=step)
    t = time.time() + mtime_offset_s
    os.utime(d, (t, t))
    return d


def test_rotation_follows_the_trainers_commit_time_rule(tmp_path, caplog):
    """checkpoint-500 of an earlier run, committed an hour ago: rotated away by commit time, as
    the plain Trainer does (it orders by mtime); the new checkpoints are kept."""
    for name, make in (("plain", plain), ("fast", fast)):
        out = tmp_path / name
        out.mkdir()
        if name == "plain":  # the Trainer's own rotation sees any checkpoint-N folder
            (out / "checkpoint-500").mkdir()
            t = time.time() - 3600
            os.utime(out / "checkpoint-500", (t, t))
        else:
            foreign(out, 500, -3600)
        with caplog.at_level(logging.WARNING, logger="fastckpt.integrations.hf.trainer"):
            make(out, save_steps=4, max_steps=8, save_total_limit=1).train()
    assert ckpt_names(tmp_path / "fast") == ckpt_names(tmp_path / "plain") == ["checkpoint-8"]
    assert "checkpoint-500" in caplog.text and "earlier run" in caplog.text


class SeenAtSave(transformers.TrainerCallback):
    def __init__(self):
        self.existed = []

    def on_save(self, args, state, control, **kw):
        self.existed.append((state.global_step, (Path(args.output_dir) / f"checkpoint-{state.global_step}").is_dir()))


def test_rotation_never_deletes_the_checkpoint_just_saved(tmp_path):
    """checkpoint-500 sorts as the most recent (mtime in the future: a clock skew, or step order
    when all lie within 1 s): the plain Trainer deletes the checkpoint it just saved; we keep it."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "checkpoint-500").mkdir()
    t = time.time() + 3600
    os.utime(tmp_path / "plain" / "checkpoint-500", (t, t))
    plain(tmp_path / "plain", save_steps=4, max_steps=8, save_total_limit=1).train()
    assert ckpt_names(tmp_path / "plain") == ["checkpoint-500"]  # the trap: both of its saves deleted
    seen = SeenAtSave()
    (tmp_path / "fast").mkdir()
    foreign(tmp_path / "fast", 500, +3600)
    tr = fast(tmp_path / "fast", callbacks=[seen], save_steps=4, max_steps=8, save_total_limit=1)
    tr.train()
    cb = next(c for c in tr.callback_handler.callbacks if isinstance(c, hf_trainer.FastCkptCallback))
    assert [r["step"] for r in cb.records] == [4, 8]
    assert ckpt_names(tmp_path / "fast") == ["checkpoint-8", "checkpoint-500"]
    assert fastckpt.is_committed(tmp_path / "fast" / "checkpoint-8")
    assert seen.existed == [(4, True), (8, True)]


def test_resume_true_names_an_earlier_runs_higher_checkpoint(tmp_path, caplog):
    out = tmp_path / "o"
    out.mkdir()
    foreign(out, 500, -3600)
    fast(out, save_steps=4, max_steps=4).train()
    with caplog.at_level(logging.WARNING, logger="fastckpt.integrations.hf.trainer"):
        got = hf_trainer.resume_checkpoint(str(out), True)  # the mixin's resolution of True
    assert got == str(out / "checkpoint-500")  # the Trainer's rule: highest step ...
    assert "checkpoint-500" in caplog.text and "checkpoint-4" in caplog.text and "earlier run" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastckpt.integrations.hf.trainer"):
        assert hf_trainer.newer_runs_warning(out, out / "checkpoint-4") == []  # ... no warning for this run's
    assert "earlier run" not in caplog.text


# ------------------------------------------------------------------------------------------------
# the rest of the Trainer's checkpointing: same as without fastckpt
# ------------------------------------------------------------------------------------------------
CONFIGS = {
    "save_total_limit": dict(save_steps=4, num_train_epochs=1, save_total_limit=2),
    "load_best_model_at_end": dict(save_steps=4, num_train_epochs=1, save_total_limit=2, eval_strategy="steps",
                                   eval_steps=4, metric_for_best_model="loss", greater_is_better=True,
                                   load_best_model_at_end=True),  # step 4 is the best (loss falls)
    "save_strategy_epoch": dict(save_strategy="epoch", num_train_epochs=2),
    "save_only_model": dict(save_steps=8, num_train_epochs=1, save_only_model=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_as_without_fastckpt(tmp_path, name):
    cfg = dict(CONFIGS[name])
    if name == "load_best_model_at_end":  # a stateful callback, saved in trainer_state.json
        early = lambda: [transformers.EarlyStoppingCallback(early_stopping_patience=100)]  # noqa: E731
    else:
        early = lambda: []  # noqa: E731
    ref = plain(tmp_path / "plain", callbacks=early(), **cfg)
    ref.train()
    tr = fast(tmp_path / "fast", callbacks=early(), **cfg)
    tr.train()
    assert ckpt_names(tmp_path / "fast") == ckpt_names(tmp_path / "plain")  # checkpoint-N naming, rotation
    last = ckpt_names(tmp_path / "fast")[-1]
    stateful = [json.loads((tmp_path / d / last / "trainer_state.json").read_text())["stateful_callbacks"]
                for d in ("plain", "fast")]
    assert stateful[0] == stateful[1]
    assert losses(tr) == losses(ref)
    best = lambda t: t.state.best_model_checkpoint and Path(t.state.best_model_checkpoint).name  # noqa: E731
    assert best(tr) == best(ref)
    assert_bit_equal(weights(tr.model), weights(ref.model))  # with load_best_model_at_end: the best's
    if name == "load_best_model_at_end":
        assert best(tr) == "checkpoint-4"
        assert_bit_equal(weights(tr.model), fastckpt.load(tmp_path / "fast" / "checkpoint-4")["model"])
    for d in ckpt_names(tmp_path / "fast"):
        snap = fastckpt.load(tmp_path / "fast" / d)
        assert ("optimizer" in snap) is (name != "save_only_model")


# ------------------------------------------------------------------------------------------------
# a model that is not a PreTrainedModel (upstream test_can_resume_training's regression model)
# ------------------------------------------------------------------------------------------------
class RegressionData(torch.utils.data.Dataset):
    def __init__(self, n=128):
        g = torch.Generator().manual_seed(42)
        self.x = torch.randn(n, generator=g)
        self.y = 2 * self.x + 3 + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class Regression(torch.nn.Module):
    """y = dropout(a * x) + b: a plain ``nn.Module`` (no config), RNG used in training."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, input_x, labels=None):
        y = self.drop(input_x * self.a) + self.b
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


def regression_trainer(out):
    args = transformers.TrainingArguments(str(out), save_steps=5, logging_steps=5, learning_rate=0.1,
                                          report_to="none", use_cpu=True, disable_tqdm=True,
                                          per_device_train_batch_size=8, num_train_epochs=3, seed=7)
    return Trainer(Regression(), args, train_dataset=RegressionData(), callbacks=[hf_trainer.FastCkptCallback()])


def test_exact_resume_of_a_plain_module(tmp_path):
    tr = regression_trainer(tmp_path)
    tr.train()
    ref = (tr.model.a.item(), tr.model.b.item())
    ref_log = steady(tr.state.log_history)
    for ckpt in ("checkpoint-5", "checkpoint-15"):  # mid-epoch 1, and across an epoch boundary
        again = regression_trainer(tmp_path)
        again.train(resume_from_checkpoint=str(tmp_path / ckpt))
        assert (again.model.a.item(), again.model.b.item()) == ref, ckpt
        assert steady(again.state.log_history) == ref_log, ckpt
