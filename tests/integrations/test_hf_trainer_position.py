"""The Trainer callback changes nothing else (issue 20, item 6): wherever ``FastCkptCallback`` sits in
the Trainer's callback list, every other callback sees the same events, in the same order, with the
same control flags, and every checkpoint's ``trainer_state.json`` (``stateful_callbacks`` included:
``EarlyStoppingCallback``, ``TrainerControl``, a user's ``ExportableState``) is the one the Trainer
writes with its own saving (transformers 5.24.0, run in the test as the reference).

Documented differences, ignored here (docs/TRAINER.md, "What differs"):
* ``on_save`` fires once the background save is committed, at the first event after the commit
  (its position among the other events depends on timing); its steps and its state are compared.
* wall-clock numbers in ``log_history`` (``*_runtime``, ``*_per_second``, ``*_time``) and the output folder in
  ``best_model_checkpoint`` (compared by name).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_hf_trainer import hf_trainer, make_trainer

import fastckpt

transformers = pytest.importorskip("transformers")
from transformers.trainer_callback import ExportableState  # noqa: E402

FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
          "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_epoch_end",
          "on_train_end")
#: Trainer run: 4 saves (4: no log, no eval; 8: log + eval; 12: log; 16: log + eval, early stop there).
ARGS = dict(max_steps=20, save_steps=4, eval_strategy="steps", eval_steps=8, logging_steps=3,
            metric_for_best_model="loss", greater_is_better=True)  # eval loss falls: step 8 stays best
_VOLATILE = ("_runtime", "_per_second", "_time", "train_loss")


class Journal:
    """One list of what every recording callback saw, in call order."""

    def __init__(self):
        self.entries: list[tuple] = []


class Recording(transformers.TrainerCallback):
    """Records each event it gets: ``(name, event, global_step, control flags on entry)``."""

    def __init__(self, name: str, journal: Journal):
        self.name, self.journal = name, journal

    def _rec(self, event, state, control):
        self.journal.entries.append((self.name, event, state.global_step,
                                     tuple(getattr(control, f) for f in FLAGS)))


for _ev in EVENTS:
    setattr(Recording, _ev, (lambda ev: lambda self, args, state, control, **kw: self._rec(ev, state, control))(_ev))


class Tally(transformers.TrainerCallback, ExportableState):
    """A user's stateful callback: counts the save and evaluate requests it sees at step end and the
    evaluations (its counts land in trainer_state.json's ``stateful_callbacks``)."""

    def __init__(self, saves: int = 0, evals: int = 0, best_seen: float | None = None):
        self.saves, self.evals, self.best_seen = saves, evals, best_seen

    def on_step_end(self, args, state, control, **kw):
        self.saves += int(control.should_save)

    def on_evaluate(self, args, state, control, **kw):
        self.evals += 1
        self.best_seen = state.best_metric  # the best *before* this evaluation, as the Trainer shows it

    def state(self) -> dict:
        return {"args": {}, "attributes": {"saves": self.saves, "evals": self.evals, "best_seen": self.best_seen}}


POSITIONS = ["handler-first", "0", "1", "2", "3", "4", "handler-last"]


def run(out: Path, position: str | None):
    """Train with [EarlyStopping, rec-a, Tally, rec-b] and FastCkptCallback at ``position`` (None:
    the Trainer's own saving). Returns (trainer, journal)."""
    journal = Journal()
    cbs = [transformers.EarlyStoppingCallback(early_stopping_patience=1), Recording("a", journal), Tally(),
           Recording("b", journal)]
    if position is not None and position.isdigit():
        cbs.insert(int(position), hf_trainer.FastCkptCallback())
    tr = make_trainer(out, mixin=False, callbacks=cbs, **ARGS)
    if position == "handler-first":  # before the Trainer's DefaultFlowCallback
        tr.callback_handler.callbacks.insert(0, hf_trainer.FastCkptCallback())
    elif position == "handler-last":  # after the Trainer's PrinterCallback
        tr.add_callback(hf_trainer.FastCkptCallback())
    tr.train()
    return tr, journal


def trainer_states(out: Path) -> dict[str, dict]:
    """``checkpoint-N -> trainer_state.json`` without the documented volatile fields."""
    got = {}
    for d in sorted(Path(out).glob("checkpoint-*")):
        st = json.loads((d / "trainer_state.json").read_text())
        st["log_history"] = [{k: v for k, v in h.items() if not k.endswith(_VOLATILE)} for h in st["log_history"]]
        if st.get("best_model_checkpoint"):
            st["best_model_checkpoint"] = Path(st["best_model_checkpoint"]).name
        got[d.name] = st
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    tr, journal = run(out, None)
    return out, tr, journal


@pytest.mark.parametrize("position", POSITIONS)
def test_other_callbacks_behave_and_save_as_without_fastckpt(tmp_path, reference, position):
    ref_out, ref_tr, ref_journal = reference
    tr, journal = run(tmp_path, position)
    assert tr.state.global_step == ref_tr.state.global_step == 16  # early stopping stopped both at 16
    ref_states, states = trainer_states(ref_out), trainer_states(tmp_path)
    assert sorted(states) == sorted(ref_states) == [f"checkpoint-{s}" for s in (12, 16, 4, 8)]
    for name in ref_states:
        assert states[name] == ref_states[name], name
        # each one fastckpt's, never the Trainer's own pickle save
        assert fastckpt.is_committed(tmp_path / name) and not (tmp_path / name / "optimizer.pt").exists(), name
    # every event of the other callbacks, in order, with the control flags they saw
    assert [e for e in journal.entries if e[1] != "on_save"] == \
        [e for e in ref_journal.entries if e[1] != "on_save"]
    # on_save: once per checkpoint, after the commit (timing documented), each with its own step
    saves = lambda j: [(e[0], e[2]) for e in j.entries if e[1] == "on_save"]  # noqa: E731
    assert saves(journal) == saves(ref_journal)
    # the live state at the end: best checkpoint, the stateful callbacks
    assert Path(tr.state.best_model_checkpoint).name == Path(ref_tr.state.best_model_checkpoint).name
    assert tr.state.stateful_callbacks == ref_tr.state.stateful_callbacks


# ------------------------------------------------------------------------------------------------
# every way transformers loads a checkpoint: the same as from the Trainer's own checkpoint
# ------------------------------------------------------------------------------------------------
def listing(root: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime_ns)`` of every file and folder under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def eval_and_predict(model, out: Path):
    """``Trainer.evaluate`` and ``Trainer.predict`` of ``model`` (loaded by ``from_pretrained``)."""
    from test_hf_trainer import IntDataset

    args = transformers.TrainingArguments(str(out), report_to="none", use_cpu=True, disable_tqdm=True,
                                          per_device_eval_batch_size=8)
    tr = transformers.Trainer(model=model, args=args, eval_dataset=IntDataset())
    metrics = {k: v for k, v in tr.evaluate().items() if not k.endswith(_VOLATILE)}
    return metrics, tr.predict(IntDataset()).predictions


def test_every_way_transformers_loads_a_fastckpt_checkpoint(tmp_path):
    """From a fastckpt checkpoint: ``from_pretrained`` (weights only), ``Trainer.evaluate`` / ``predict``
    of that model and ``train(resume_from_checkpoint=True)`` in the same output_dir give exactly what they
    give from the Trainer's own checkpoint of the same run; the reads leave the folders as they were
    (still verified), and after ``fastckpt prune --keep 1`` nothing but one checkpoint is left."""
    import numpy as np
    import torch

    from fastckpt.cli.main import main

    AutoModel = transformers.AutoModelForCausalLM
    cfg = dict(max_steps=16, save_steps=8, logging_steps=4)
    runs = {"plain": None, "fast": [hf_trainer.FastCkptCallback()]}
    for name, cbs in runs.items():
        make_trainer(tmp_path / name, mixin=False, callbacks=cbs or [], **cfg).train()
    before = listing(tmp_path / "fast")
    for ck in ("checkpoint-8", "checkpoint-16"):
        ref, got = (AutoModel.from_pretrained(tmp_path / d / ck) for d in ("plain", "fast"))
        ref_sd, got_sd = ref.state_dict(), got.state_dict()
        assert ref_sd.keys() == got_sd.keys()
        for k in ref_sd:
            assert torch.equal(ref_sd[k], got_sd[k]), (ck, k)
        m_ref, p_ref = eval_and_predict(ref, tmp_path / "eval-plain")
        m_got, p_got = eval_and_predict(got, tmp_path / "eval-fast")
        assert m_got == m_ref, ck
        assert np.array_equal(p_got, p_ref), ck
    assert listing(tmp_path / "fast") == before  # reading wrote nothing into the run
    for ck in ("checkpoint-8", "checkpoint-16"):
        assert main(["verify", str(tmp_path / "fast" / ck)]) == 0
    resumed = {}
    for name, cbs in runs.items():  # resume_from_checkpoint=True in the same output_dir: from checkpoint-16
        tr = make_trainer(tmp_path / name, mixin=False, callbacks=cbs and [hf_trainer.FastCkptCallback()] or [],
                          **{**cfg, "max_steps": 24})
        tr.train(resume_from_checkpoint=True)
        resumed[name] = tr
    a, b = resumed["plain"].model.state_dict(), resumed["fast"].model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h for h in resumed["fast"].state.log_history if "loss" in h] == \
        [h for h in resumed["plain"].state.log_history if "loss" in h]
    assert sorted(p.name for p in (tmp_path / "fast").iterdir()) == \
        sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["checkpoint-16", "checkpoint-24", "checkpoint-8"]
    assert main(["prune", str(tmp_path / "fast"), "--keep", "1"]) == 0
    # and the root lock file prune takes (fastckpt/storage/lock.py: never deleted, deleting lock files races)
    assert sorted(p.name for p in (tmp_path / "fast").iterdir()) == [".fastckpt.storage.lock", "checkpoint-24"]


def test_without_a_trainer_on_the_stack_the_callback_still_takes_every_save(tmp_path, monkeypatch):
    """No Trainer frame found (a future transformers, events called through a wrapper): the callback
    cannot reorder the list and reads the save request in its own events; every save (one deferred
    to the step's log entry, one to the evaluation) is still its own, none the Trainer's pickle save."""
    monkeypatch.setattr(hf_trainer, "find_trainer", lambda: (None, None))
    cb = hf_trainer.FastCkptCallback()
    tr = make_trainer(tmp_path, mixin=False, callbacks=[cb], max_steps=8, save_steps=4, logging_steps=2,
                      eval_strategy="steps", eval_steps=8)
    tr.train()
    assert cb._tail is None and [r["step"] for r in cb.records] == [4, 8]
    for s in (4, 8):
        d = tmp_path / f"checkpoint-{s}"
        assert fastckpt.is_committed(d) and not (d / "optimizer.pt").exists()
        st = json.loads((d / "trainer_state.json").read_text())
        assert [h["step"] for h in st["log_history"] if "loss" in h] == list(range(2, s + 1, 2))


def test_rotation_of_a_new_run_in_an_old_output_dir_is_the_trainers(tmp_path):
    """An earlier run left checkpoint-12 and -16 (save_total_limit=2); a new run in the same output_dir
    saves 4 and 8: the same folders remain as with the Trainer's own rotation (by modification time:
    the earlier run's go first), after the same sequence of runs."""
    import time

    kept = {}
    for name in ("plain", "fast"):
        out = tmp_path / name
        cbs = lambda: [hf_trainer.FastCkptCallback()] if name == "fast" else []  # noqa: E731
        make_trainer(out, mixin=False, callbacks=cbs(), max_steps=16, save_steps=4, save_total_limit=2).train()
        time.sleep(1.2)  # the Trainer orders by step when all mtimes lie within 1 s
        make_trainer(out, mixin=False, callbacks=cbs(), max_steps=8, save_steps=4, save_total_limit=2).train()
        kept[name] = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept["fast"] == kept["plain"] == ["checkpoint-4", "checkpoint-8"]
