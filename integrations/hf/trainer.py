"""Hugging Face ``Trainer`` integration: asynchronous, atomic, pickle-free checkpoints.

Usage (the callback alone is enough; docs/TRAINER.md lists every Trainer feature)::

    from fastckpt.integrations.hf.trainer import FastCkptCallback

    trainer = Trainer(model=..., args=args, train_dataset=..., callbacks=[FastCkptCallback()])
    trainer.train()                                   # writes output_dir/checkpoint-N via fastckpt
    trainer.train(resume_from_checkpoint=True)        # or a folder: exact resume

Saving: the callback intercepts every save the Trainer decides on (read once every other callback
has seen the event: at train begin it moves itself first in the Trainer's callback list and adds a
:class:`FastCkptTail` last, so its position in ``callbacks=[...]`` changes nothing for the others),
sets ``control.should_save = False`` so the Trainer's own pickle save never runs, and starts
:func:`fastckpt.async_save` of a whole snapshot into ``checkpoint-N`` (HF-layout weights, adapter files, optimizer, scheduler, RNG
states, ``trainer_state.json``, generation config and tokenizer files). Once it is committed the
other callbacks' ``on_save`` fires (:mod:`~fastckpt.integrations.hf.on_save`). A background
failure is re-raised in the training process with its original type.

Resume: the Trainer loads the model through its own (safetensors) loader; the callback restores
optimizer, scheduler and RNG states from the folder the Trainer resumes from (read off its training
loop, :func:`~fastckpt.integrations.hf.resume.find_trainer`). :class:`FastCkptTrainerMixin` is
optional: it makes ``resume_from_checkpoint=True`` skip uncommitted ``checkpoint-N`` folders.

Helpers live in :mod:`~fastckpt.integrations.hf.checkpoints` (folders, rotation),
:mod:`~fastckpt.integrations.hf.snapshot`, :mod:`~fastckpt.integrations.hf.resume` and
:mod:`~fastckpt.integrations.hf.step_gate`. Multi-process training (DDP, FSDP2): every rank takes
part in each save, the model is written once, each rank's RNG state is its own
(:mod:`~fastckpt.integrations.hf.rank_state`; docs/TRAINER.md "Multi-process").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import fastckpt
from fastckpt import no_gc
from fastckpt.errors import CheckpointExistsError, LinkedTensorChangedError, SourceChangedError, UnsupportedTrainerOptionError
from fastckpt.storage import clean_stale_temps

from .checkpoints import (  # noqa: F401  (re-exported: public helpers, tests)
    PREFIX_CHECKPOINT_DIR, foreign_checkpoints_ahead, get_last_checkpoint, is_trainers_last, logged_this_step,
    newer_runs_warning, rotate_checkpoints, scheduler_as_after_evaluate, update_best_metric, update_stateful_callbacks)
from .on_save import OnSaveRelay, state_as_of_now
from .rank_state import is_sharded, optimizer_state, rank_save_options, trainer_group
from .resume import TrainerResume, find_trainer, resume_checkpoint, skip_fsdp_model_load, trainer_being_built
from .snapshot import (  # noqa: F401  (re-exported: accelerate plugin, scripts)
    ModelSnapshotter, capture_rng_state, dedup_tied, is_peft_model, model_snapshot, peft_base_weights,
    restore_rng_state, snapshot_bytes_estimate, tokenizer_files)
from .step_gate import OptimizerStepGate, param_or_optimizer_state

logger = logging.getLogger(__name__)


#: Options of :func:`fastckpt.async_save` a user may set; the callback sets ``step``, ``link_from``
#: (the newest committed checkpoint), ``weights``, ``extra_files``, ``metadata`` and ``defer`` itself.
_CALLBACK_SAVE_OPTIONS = frozenset({"max_shard_bytes", "chunk_bytes", "threads", "staging_bytes", "o_direct",
                                    "io_backend", "min_free_bytes", "link_check", "early_writes",
                                    "defer_frozen"})


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class FastCkptCallback(_trainer_callback_base()):
    """Take over the Trainer's checkpoint saving with fastckpt (async, atomic, no pickle).

    Args:
        save_options: keyword options passed on to :func:`fastckpt.async_save`
            (``max_shard_bytes``, ``threads``, ``staging_bytes``, ``o_direct``), plus
            ``link_unchanged`` (default ``True``): shard files whose bytes equal the newest
            committed checkpoint's (a LoRA run's frozen base weights) are hard-linked from it
            instead of copied and rewritten (``link_from`` of :func:`fastckpt.async_save` with
            ``link_check="version"``: a frozen tensor whose storage and version counter are
            those of the previous save is not hashed at the call but re-hashed by xxh3 in the
            background before the commit, so the snapshot stays exact; pass
            ``link_check="hash"`` to hash at the call instead). With ``link_check="version"``
            the frozen parameters are hashed once in the background at train begin
            (:func:`fastckpt.prime_hashes`) and ``defer_frozen`` defaults to ``True``: the first
            save, which has nothing to link from, copies them in the background and checks the
            copy against that hash, so training waits only for the adapter, optimizer and RNG copy.
            ``defer_params`` (default ``True``): the trainable parameters and the optimizer state are
            not copied during the save call but by the writer thread while the next step's
            forward and backward run; an optimizer step pre-hook makes the next ``step()`` wait
            until that copy is done (the pipelined snapshot of CheckFreq, Mohan et al., FAST
            2021), so the checkpoint holds exactly the state at the save. Buffers, scheduler, RNG
            and trainer state are copied at the call. A parameter written in place before the
            copy (outside the optimizer) fails that save (:class:`~fastckpt.errors.SourceChangedError`,
            dropped like a ``LinkedTensorChangedError`` below, later saves copy at the call).
            Only with a ``torch.optim.Optimizer`` (unwrapped from accelerate's wrapper).
        resume_from: checkpoint folder to restore optimizer/scheduler/RNG from when the Trainer
            resumes; default None = the folder the Trainer resumes from (found on its stack, else
            ``output_dir/checkpoint-{global_step}``).

    Attributes:
        records: one dict per finished save: ``step``, ``path``, ``blocking_s`` (seconds training
            stood still for it: from the start of the save to the return of the call, plus
            ``staging_wait_s``, the time the next optimizer step waited for its background copy),
            ``total_s`` (from the same start to the commit), ``bytes``, ``linked_bytes``.
        failed_saves: ``{"step", "path", "error"}`` of saves dropped by :meth:`wait`.
        (Timings go to ``records`` and the INFO log, never to ``state.log_history``.)

    Raises:
        TypeError: at construction, a save option :func:`fastckpt.async_save` would not take here
            (or one the callback sets itself: ``step``, ``link_from``, ``weights``, ...).
        ValueError: at construction, a bad option value (as :meth:`fastckpt.SaveOptions.check`).

    Raises (from the Trainer's calls):
        UnsupportedTrainerOptionError: ``push_to_hub=True`` (a ``ValueError``; at train begin).
        ResumeMismatchError: the resumed folder holds another step (a ``ValueError``).
        FastCkptError / OSError: a background save failed (re-raised with its type at the next
            save, the next step end, train end or SIGTERM). Multi-process: ``DistributedSaveError``
            naming the failed rank, on every rank at the same event (the next save or train end).
    """

    def __init__(self, resume_from: str | os.PathLike | None = None, **save_options):
        self._saver = fastckpt.Saver()  # this callback's own: its failures surface only in its calls
        self.link_unchanged = bool(save_options.pop("link_unchanged", True))
        self.defer_params = bool(save_options.pop("defer_params", True))
        save_options.setdefault("link_check", "version")
        save_options.setdefault("defer_frozen", save_options["link_check"] == "version")
        unknown = sorted(set(save_options) - _CALLBACK_SAVE_OPTIONS)
        if unknown:  # a typo must not surface only at the first save, mid-training
            raise TypeError(f"FastCkptCallback got unknown save option(s) {unknown}; "
                            f"valid: {sorted(_CALLBACK_SAVE_OPTIONS)}, link_unchanged and defer_params "
                            "(step, link_from, weights, extra_files and metadata are set by the callback)")
        fastckpt.SaveOptions(**save_options).check()  # a bad value fails here, not mid-training
        self._snapshot = ModelSnapshotter()  # key -> parameter map, built once (at train begin)
        self.save_options = save_options
        self.resume_from = str(resume_from) if resume_from is not None else None
        self.records: list[dict[str, Any]] = []
        self.failed_saves: list[dict[str, Any]] = []
        self._pending = None  # (future, step, path, blocking_s, t_start, t_call, state as of the save)
        self._inflight = None  # future of the newest save, never cleared: read lock-free by the SIGTERM handler
        self._processing_class = None
        self._tok_cache: tuple[int, dict[str, bytes]] | None = None  # (id(processing_class), files)
        self._lock = threading.Lock()
        self._save_after_eval = False
        self._save_after_log = False
        self._trainer = None  # weakref to the Trainer found at train begin
        self._tail = None  # FastCkptTail: reads the save request after every other callback (train begin)
        self._training = False
        self._epoch_rng: dict[str, Any] | None = None
        self._resume = TrainerResume()  # optimizer/scheduler at train begin, RNG at epoch/step begin
        self._prev_sigterm = None
        self._gate = OptimizerStepGate(self._pending_save)  # defer_params: step() waits for staging
        self._model = self._args = self._state = None
        self.trainer_callbacks = None  # set by FastCkptTrainerMixin: all callbacks of the Trainer
        self._relay = OnSaveRelay()  # on_save of the other callbacks, after each commit
        self._eval_warned = False
        self._before_loop = False  # between on_train_begin and the first on_epoch_begin (eval_on_start)
        self._eval_round: tuple[int, int, dict] | None = None  # (step, on_evaluate calls, merged metrics)

    def on_init_end(self, args, state, control, **kw):
        skip_fsdp_model_load(trainer_being_built())  # before train() loads a checkpoint under FSDP

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if args.push_to_hub:
            raise UnsupportedTrainerOptionError(
                "FastCkptCallback does not push to the Hub (TrainingArguments.push_to_hub=True): set "
                "push_to_hub=False and upload a committed checkpoint folder with "
                "huggingface_hub.upload_folder after training")
        trainer, resumed_from = find_trainer()
        if args.deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
            raise UnsupportedTrainerOptionError(
                "FastCkptCallback does not checkpoint a DeepSpeed Trainer run (TrainingArguments.deepspeed): the "
                "DeepSpeed engine owns the optimizer and its partitions (the callback failed at the first step or "
                "save). Remove the callback to keep the Trainer's own DeepSpeed checkpoints; outside the Trainer, "
                "fastckpt.integrations.deepspeed.engine.install(engine) saves DeepSpeed engines")
        steps = state.save_steps if args.save_strategy == "steps" else None
        if args.save_strategy != "no" and (ahead := foreign_checkpoints_ahead(args.output_dir, state.global_step,
                                                                             state.max_steps, steps)):
            raise CheckpointExistsError(
                f"{ahead[0]} is a checkpoint folder fastckpt did not write (the Trainer's own, from an earlier run, or "
                f"a crashed save){f' (and {len(ahead) - 1} more)' if len(ahead) > 1 else ''}, at a step this run saves "
                f"at: its save would stop there after training up to it (fastckpt never writes into another "
                f"writer's folder). Resume from it (resume_from_checkpoint=...), or move it away or choose another "
                f"output_dir; nothing was trained")
        self._relay.attach(trainer)
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._arrange(getattr(trainer, "callback_handler", None))
        self._training = True
        self._before_loop = True
        self._refs(args, state, {**kw, "model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler})
        self._install_sigterm()
        self._tokenizer_files()  # saved once now, not during the first save
        if model is not None:
            self._snapshot(model)  # learn the key -> parameter map now, not during the first save
            if not args.save_only_model:
                self._saver.reserve(snapshot_bytes_estimate(model))  # first save copies into touched memory
        if state.global_step > 0:
            ckpt = self.resume_from or (str(resumed_from) if resumed_from else None)
            if ckpt is None:
                ckpt = str(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            elif self.resume_from is None and is_trainers_last(args.output_dir, ckpt):
                newer_runs_warning(args.output_dir, ckpt)  # resume_from_checkpoint=True may have picked it
            self._resume.restore(ckpt, args, state, optimizer, lr_scheduler, model,
                                 self._snapshot(model)[0].get("model") if model is not None else None)
        if self.defer_params and not args.save_only_model:
            self._gate.install(optimizer)
        if model is not None and not is_sharded(model) and self.save_options.get("link_check") == "version" \
                and (self.link_unchanged or self.save_options.get("defer_frozen")):
            # hash the frozen base weights in the background now: the first save then links them
            # (after --resume) or copies them in the background (defer_frozen), not while training waits
            snap, weights, _ = self._snapshot(model)
            self._saver.prime_hashes(snap, weights=weights)

    def on_epoch_begin(self, args, state, control, **kw):
        self._before_loop = False
        self._tick(args, control)
        self._flush_deferred(args, state, control)  # before the sampler draws the next epoch's shuffle
        self._resume.at_epoch_begin()
        self._epoch_rng = capture_rng_state()

    def on_step_begin(self, args, state, control, **kw):
        self._tick(args, control)
        self._flush_deferred(args, state, control)
        self._resume.at_step_begin()

    on_substep_end = on_pre_optimizer_step = on_optimizer_step = on_prediction_step = \
        lambda self, args, state, control, **kw: self._tick(args, control)  # noqa: E731

    def on_step_end(self, args, state, control, **kw):
        self._refs(args, state, kw)
        self._tick(args, control)
        if self._tail is None:
            self._end_of_step(args, state, control)

    def on_epoch_end(self, args, state, control, **kw):
        self._refs(args, state, kw)
        self._tick(args, control)
        self._flush_deferred(args, state, control)  # a save due after an on_evaluate that never came
        if self._tail is None:
            self._end_of_epoch(args, state, control)

    def on_log(self, args, state, control, logs=None, **kw):
        self._tick(args, control)
        self._reassert(control)
        if self._tail is None:
            self._end_of_log(args, state, control, kw)

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self._tick(args, control)
        self._reassert(control)
        if self._tail is None:
            self._end_of_evaluate(args, state, control, metrics, kw)

    def on_train_end(self, args, state, control, **kw):
        try:
            self._tick(args, control)
            self._flush_deferred(args, state, control)
            self.wait(args)
            self._relay.fire(args, control)  # the last save's on_save before train() returns
        finally:
            self._training = False
            self._uninstall_sigterm()
            self._gate.remove()

    # -- the Trainer's save request, read once every other callback has run (FastCkptTail) ----------
    def _arrange(self, handler) -> None:
        """Put this callback first and a :class:`FastCkptTail` last in ``handler.callbacks`` (the
        Trainer's ``CallbackHandler``; in place, inside its ``on_train_begin`` loop), so that every
        other callback gets each event with the flags the Trainer set, and the save request is read
        once all of them have run. Without a handler, or in a list this cannot safely reorder, the
        callback reads the request in its own events (then its position matters)."""
        self._tail = None
        cbs = getattr(handler, "callbacks", None)
        if not isinstance(cbs, list):
            return
        at = next((i for i, c in enumerate(cbs) if c is self), None)
        mine = [i for i, c in enumerate(cbs) if isinstance(c, FastCkptTail) and c.head is self]
        if at is None or any(i < at for i in mine):  # the running loop would skip a callback
            return
        tail = cbs[mine[0]] if mine else FastCkptTail(self, cbs)
        others = [c for i, c in enumerate(cbs) if c is not self and i not in mine]
        cbs[:] = [self, *others, tail]  # the running loop goes on at index at + 1: the callback after this one
        self._tail = tail

    def _reassert(self, control) -> None:
        """At the start of ``on_log`` / ``on_evaluate``: a save the Trainer asked for at this step and
        the callback deferred to this event is asked for again (``control.should_save``), so the other
        callbacks see the flag as the Trainer left it (and may still cancel it, as with the Trainer)."""
        if self._save_after_log or self._save_after_eval:
            control.should_save = True

    def _end_of_step(self, args, state, control) -> None:
        """``on_step_end`` once every other callback has run: intercept the Trainer's save request."""
        self._intercept(args, state, control)

    def _end_of_epoch(self, args, state, control) -> None:
        """``on_epoch_end`` once every other callback has run."""
        self._intercept(args, state, control)
        if control.should_training_stop:
            self.wait(args)

    def _end_of_log(self, args, state, control, kw) -> None:
        """``on_log`` once every other callback has run: a save deferred to this step's log entry."""
        if not (self._training or self._save_after_eval or self._save_after_log):
            return  # a log outside training (evaluate() called by hand): the Trainer saves nothing there
        asked, control.should_save = control.should_save, False
        if self._save_after_eval:  # the evaluation's own log entry: the save waits for on_evaluate
            self._save_after_eval = asked
        elif self._save_after_log:
            self._save_after_log = False
            if asked:  # not cancelled by another callback's on_log
                self._refs(args, state, kw)
                self._save(args, state, control)
        elif asked and self._training:  # another callback asked for a save in on_log: the Trainer would save
            control.should_save = True
            self._intercept(args, state, control)

    def _end_of_evaluate(self, args, state, control, metrics, kw) -> None:
        """``on_evaluate`` once every other callback has run: best metric, then a deferred save.

        As ``Trainer._maybe_log_save_evaluate``: ``eval_on_start``'s evaluation (before the first
        epoch) neither counts for the best metric nor steps the scheduler nor saves; with several eval
        datasets (``eval_dataset`` a dict: one ``on_evaluate`` each) the merged metrics of the last one
        decide; a ``ReduceLROnPlateau`` scheduler is saved as the Trainer leaves it after this evaluation
        (it steps it right after ``on_evaluate``)."""
        if not self._training or metrics is None or self._before_loop:
            return
        self._refs(args, state, kw)
        n = self._eval_datasets()
        step, seen, merged = self._eval_round if self._eval_round and self._eval_round[0] == state.global_step \
            else (state.global_step, 0, {})
        merged = {**merged, **metrics}
        if seen + 1 < n:  # more datasets of this evaluation to come
            self._eval_round = (step, seen + 1, merged)
            return
        self._eval_round = None
        # the Trainer's _determine_best_metric runs right after on_evaluate: done here first, the Trainer
        # sees no new best, so its own save_strategy="best" save never runs; the other callbacks'
        # on_evaluate saw state.best_metric as the Trainer shows it (before this evaluation)
        is_best = update_best_metric(args, state, merged)
        asked, control.should_save = control.should_save, False
        self._save_after_eval = self._save_after_log = False
        if args.save_strategy == "best" and not is_best or args.save_strategy != "best" and not asked:
            return
        with scheduler_as_after_evaluate(args, getattr(self, "_lr_scheduler", None),
                                         getattr(self, "_optimizer", None), merged):
            self._save(args, state, control)

    def _eval_datasets(self) -> int:
        """How many ``on_evaluate`` calls one evaluation of the Trainer makes (its ``eval_dataset`` dict)."""
        trainer = self._trainer() if self._trainer is not None else None
        ds = getattr(trainer, "eval_dataset", None)
        return len(ds) if isinstance(ds, dict) and ds else 1

    def _intercept(self, args, state, control) -> None:
        """Take over a save request (``control.should_save``): save now, or once this step's log entry
        or evaluation is done, as the Trainer's ``_maybe_log_save_evaluate`` orders them."""
        if not control.should_save:
            return
        control.should_save = False
        if args.save_strategy == "best":
            return
        if control.should_evaluate:
            self._save_after_eval = True  # save after metrics/best are known, as the Trainer does
        elif control.should_log and not logged_this_step(state):
            # the Trainer logs this step right after on_step_end and saves after logging: save in
            # on_log, so trainer_state.json holds this step's log entry as the Trainer's own would
            self._save_after_log = True
        else:
            self._save(args, state, control)

    def _flush_deferred(self, args, state, control) -> None:
        """A save deferred to on_log or on_evaluate whose event never came (a Trainer subclass that
        evaluates without ``on_evaluate``): do it now, at the next event, rather than never."""
        if self._save_after_eval and not self._eval_warned:
            self._eval_warned = True
            logger.warning("fastckpt: checkpoint-%d fell on an evaluation step but on_evaluate never came (does "
                           "the Trainer subclass override evaluate()?): saved at the next event instead, with "
                           "best_metric as the Trainer left it", state.global_step)
        if self._save_after_log or self._save_after_eval:
            self._save_after_log = self._save_after_eval = False
            self._save(args, state, control)

    def _tick(self, args, control) -> None:
        """At every event: collect a save committed meanwhile, then fire the other callbacks'
        ``on_save`` for each commit not yet announced (training thread, first event after commit)."""
        self._poll()
        self._relay.fire(args, control)

    def _save(self, args, state, control) -> None:
        if not args.should_save and trainer_group(args) is None:  # multi-rank: every rank saves together
            return
        with no_gc():  # building the snapshot allocates thousands of objects (see fastckpt.saving.saver.no_gc)
            self._save_now(args, state, control)

    def _save_now(self, args, state, control) -> None:
        self.wait(args)
        self._relay.fire(args, control)  # before this save's rotation can delete the folder it announces
        out = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        t0 = time.perf_counter()
        if self._model is None:
            raise RuntimeError("FastCkptCallback has no model: the Trainer did not call on_train_begin")
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and getattr(trainer, "hp_search_backend", None) is None:
            trainer.store_flos()  # as Trainer._save_checkpoint: total_flos up to this step (all ranks)
        snap, weights, extra = self._snapshot(self._model)
        for name, data in self._tokenizer_files().items():
            extra.setdefault(name, data)
        if not args.save_only_model:
            opt, sched = getattr(self, "_optimizer", None), getattr(self, "_lr_scheduler", None)
            snap["optimizer"] = optimizer_state(self._model, opt)  # FSDP2: DCP's, DTensor values
            snap["scheduler"] = sched.state_dict() if sched is not None else None
            snap["rng"] = capture_rng_state()
            snap["epoch_rng"] = self._epoch_rng
        snap["trainer"] = {"global_step": state.global_step, "epoch": state.epoch,
                           "save_only_model": bool(args.save_only_model)}
        if args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
            best = out.parent / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
            if best == out or best.exists():  # as Trainer._save_checkpoint, spelled as it spells it
                state.best_model_checkpoint = os.path.join(args.output_dir, best.name)  # (./out/..., not out/...)
        others = self.trainer_callbacks
        if others is None and self._relay.handler is not None:
            others = self._relay.handler.callbacks  # live list: the Trainer may replace callbacks on resume
        update_stateful_callbacks(state, others or (), control)
        extra["trainer_state.json"] = (
            json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n").encode()
        if args.should_save:
            clean_stale_temps(args.output_dir)  # leftovers of a killed earlier save (dead writers only)
        opts = dict(self.save_options)
        if self.link_unchanged:
            prev = get_last_checkpoint(args.output_dir)
            if prev is not None and Path(prev).resolve() != out.resolve():
                opts["link_from"] = prev
        if self._gate.active:
            opts["defer"] = param_or_optimizer_state  # copied while the next step computes
        opts = rank_save_options(trainer_group(args), snap, opts)
        t_call = time.perf_counter()
        fut = self._saver.async_save(snap, out, overwrite=True, weights=weights, extra_files=extra,
                                     step=state.global_step, **opts)  # weights __metadata__: {"format": "pt"}, as the Trainer
        self._inflight = fut  # what the SIGTERM handler waits for (without the lock)
        blocking = time.perf_counter() - t0
        with self._lock:
            self._pending = (fut, state.global_step, out, blocking, t0, t_call, state_as_of_now(state))
        logger.info("fastckpt: checkpoint-%d staged in %.3f s, writing in background",
                    state.global_step, blocking)
        if state.max_steps and state.global_step >= state.max_steps:
            if self.wait(args) is False:  # last save: let load_best_model_at_end and the caller see it
                self._save(args, state, control)  # dropped: training is over, save again by hashing

    def _refs(self, args, state, kw) -> None:
        """Keep the live objects the Trainer hands to every event."""
        self._args, self._state = args, state
        for name in ("model", "optimizer", "lr_scheduler"):
            if kw.get(name) is not None:
                setattr(self, f"_{name}", kw[name])
        tok = kw.get("processing_class") if kw.get("processing_class") is not None else kw.get("tokenizer")
        if tok is not None:
            self._processing_class = tok

    def _tokenizer_files(self) -> dict[str, bytes]:
        """Tokenizer/processor files of the Trainer's ``processing_class`` (saved once, cached)."""
        tok = self._processing_class
        if tok is None:
            return {}
        if self._tok_cache is None or self._tok_cache[0] != id(tok):
            try:
                files = tokenizer_files(tok)
            except Exception as e:  # a broken tokenizer must not stop training
                logger.warning("fastckpt: could not save the tokenizer (%s: %s); checkpoints carry no "
                               "tokenizer files", type(e).__name__, e)
                files = {}
            self._tok_cache = (id(tok), files)
        return self._tok_cache[1]

    def wait(self, args=None) -> bool:
        """Block until the pending save is committed, record its timings, apply rotation.

        Returns:
            False if the pending save was dropped because a frozen weight changed behind its
            version counter (:class:`~fastckpt.errors.LinkedTensorChangedError`, e.g. peft's
            ``merge_adapter``/``unmerge_adapter`` write through ``.data``): logged as a WARNING,
            listed in ``failed_saves``, and later saves hash frozen weights at the call
            (``link_check="hash"``); the earlier checkpoints are untouched. True otherwise.

        Raises:
            The background save's own exception (original type), once, for any other failure.
        """
        with self._lock:
            pending, self._pending = self._pending, None
        return self._collect(pending, args)

    def _collect(self, pending, args) -> bool:
        """:meth:`wait` for a pending save already taken out of ``self._pending``."""
        if pending is None:
            return True
        fut, step, out, blocking, t0, t_call, state_then = pending
        try:
            path = fut.result()
        except (LinkedTensorChangedError, SourceChangedError) as e:
            self._gate.pop_wait(step)
            if isinstance(e, LinkedTensorChangedError):
                self.save_options["link_check"] = "hash"
                then = "hash frozen weights at the call (link_check='hash')"
            else:
                self.save_options["defer_frozen"] = False
                self._gate.remove()
                then = "copy the whole state at the call (defer_params off)"
            self.failed_saves.append({"step": step, "path": str(out), "error": f"{type(e).__name__}: {e}"})
            logger.warning("fastckpt: checkpoint-%d was not committed: %s: %s. Later saves %s.", step,
                           type(e).__name__, e, then)
            return False
        saver_s = getattr(fut, "total_s", None)  # the saver's own: from its call to the commit
        total = (t_call - t0) + saver_s if saver_s is not None else time.perf_counter() - t0
        gate = self._gate.pop_wait(step)
        rec = {"step": step, "path": str(path), "blocking_s": blocking + gate, "staging_wait_s": gate,
               "total_s": max(total, blocking),
               "bytes": int(getattr(fut, "bytes_written", 0) or 0),
               "linked_bytes": int(getattr(fut, "bytes_linked", 0) or 0)}
        self.records.append(rec)
        gbps = rec["bytes"] / rec["total_s"] / 1e9 if rec["total_s"] else float("nan")
        logger.info("fastckpt: checkpoint-%d committed: %.3f s blocking (%.3f s of it at the next optimizer "
                    "step), %.3f s total, %d bytes, %.3f GB/s", step, rec["blocking_s"], gate, rec["total_s"],
                    rec["bytes"], gbps)
        if args is not None and args.should_save:  # the main process rotates
            rotate_checkpoints(args.output_dir, args.save_total_limit, getattr(self._state, "best_model_checkpoint", None),
                               just_saved=path)
        if state_then is not None:
            self._relay.committed(state_then)  # on_save fires at the next event (training thread)
        return True

    def _poll(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is not None and pending[0].done() and trainer_group(self._args) is None:  # multi-rank: at the
            self.wait(self._args)  # next save or train end, so every rank raises a failure at the same event

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _pending_save(self):
        """``(future, step)`` of the save in flight, or ``None`` (for the step gate)."""
        with self._lock:
            pending = self._pending
        return None if pending is None else (pending[0], pending[1])

    def _uninstall_sigterm(self) -> None:
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM: wait until the save in flight is committed (or failed), then pass the signal on.

        A signal handler runs in the main thread between two bytecodes, possibly inside one of this
        callback's ``with self._lock:`` blocks, so it never waits for that lock: it waits for the save's
        future itself (``self._inflight``, read without the lock; only the commit thread sets it
        done), then, if the lock is free (non-blocking try), collects it as :meth:`wait` does
        (records; a background failure re-raised with its type). Otherwise the training thread
        collects it after the handler returns, if the process is still alive.
        """
        logger.warning("fastckpt: SIGTERM: completing the pending save before exit")
        prev = self._prev_sigterm
        try:
            fut = self._inflight
            if fut is not None:
                fut.exception()  # waits for the commit thread only; never raises
            if self._lock.acquire(blocking=False):
                try:
                    pending, self._pending = self._pending, None
                finally:
                    self._lock.release()
                self._collect(pending, None)
        finally:
            self._uninstall_sigterm()
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                signal.raise_signal(signal.SIGTERM)


class FastCkptTail(_trainer_callback_base()):
    """The second half of :class:`FastCkptCallback`, placed last in the Trainer's callback list.

    At ``on_train_begin`` the callback moves itself first and this tail last (``head._arrange``), so
    its position in the list never matters: at the start of each event (the callback, first) it fires
    committed saves' ``on_save`` and restores what other callbacks should see; at the end (the tail,
    after every other callback, as the Trainer's own ``_maybe_log_save_evaluate`` comes after them)
    it reads ``control.should_save``, clears it so the Trainer's pickle save never runs, and starts the
    fastckpt save, with ``stateful_callbacks`` and ``best_metric`` as every callback left them.

    Args:
        head: the :class:`FastCkptCallback` it belongs to.
        callbacks: the Trainer's callback list holding both (``None``: always act); once ``head`` is
            removed from it (``trainer.remove_callback``), the tail does nothing.
    """

    def __init__(self, head: FastCkptCallback, callbacks: list | None = None):
        self.head = head
        self._callbacks = callbacks  # the list both are in: a head removed from it (pop_callback) is left alone

    def _live(self) -> bool:
        return self._callbacks is None or any(c is self.head for c in self._callbacks)

    def on_step_end(self, args, state, control, **kw):
        if self._live():
            self.head._end_of_step(args, state, control)

    def on_epoch_end(self, args, state, control, **kw):
        if self._live():
            self.head._end_of_epoch(args, state, control)

    def on_log(self, args, state, control, logs=None, **kw):
        if self._live():
            self.head._end_of_log(args, state, control, kw)

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        if self._live():
            self.head._end_of_evaluate(args, state, control, metrics, kw)


class FastCkptTrainerMixin:
    """Optional one-line ``Trainer`` mixin: ``class MyTrainer(FastCkptTrainerMixin, Trainer): pass``.

    The callback alone resumes exactly (it reads the folder off the Trainer's training loop). The
    mixin adds a :class:`FastCkptCallback` when none was passed, gives it every callback of the
    Trainer, and resolves ``resume_from_checkpoint=True`` with :func:`get_last_checkpoint`: the
    highest *committed* ``checkpoint-N`` (the Trainer's own rule takes the highest folder, committed
    or not), warning when it was committed before lower-numbered ones (an earlier run's).

    Raises:
        fastckpt.errors.TrainerCheckpointNotFoundError: ``resume_from_checkpoint=True`` and no
            committed checkpoint exists in ``args.output_dir`` (a ``ValueError``, as the Trainer's).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cbs = [cb for cb in self.callback_handler.callbacks if isinstance(cb, FastCkptCallback)]
        if not cbs:
            self.add_callback(FastCkptCallback())
            cbs = [cb for cb in self.callback_handler.callbacks if isinstance(cb, FastCkptCallback)]
        self.fastckpt_callback = cbs[0]
        self.fastckpt_callback.trainer_callbacks = self.callback_handler.callbacks
        skip_fsdp_model_load(self)  # a callback added after __init__ never saw on_init_end

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        resume_from_checkpoint = resume_checkpoint(self.args.output_dir, resume_from_checkpoint)
        if resume_from_checkpoint:
            self.fastckpt_callback.resume_from = str(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)
