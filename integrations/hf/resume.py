"""Exact resume of a ``Trainer`` run from a fastckpt checkpoint: optimizer, scheduler, RNG.

The Trainer restores the model weights itself (through its safetensors loader) when
``train(resume_from_checkpoint=...)`` names a checkpoint folder. What it would read from its
pickle files (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``) the callback takes from the
fastckpt checkpoint instead, through :class:`TrainerResume`:

* at train begin: the optimizer and scheduler states (and a check that the checkpoint holds the
  step the Trainer resumed at);
* the RNG states (each rank its own, :mod:`~fastckpt.integrations.hf.rank_state`) exactly where the
  Trainer would restore ``rng_state.pth``: at the first epoch begin when the checkpoint lies on an epoch boundary; otherwise the RNG state of the start of
  that epoch first (so the sampler draws the same shuffle and the Trainer skips the same
  batches), then the saved RNG state at the first step of the resumed run.

:func:`resume_checkpoint` resolves ``resume_from_checkpoint=True`` to the newest *committed*
checkpoint (what :class:`~fastckpt.integrations.hf.trainer.FastCkptTrainerMixin` uses).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

import fastckpt
from fastckpt.errors import ResumeMismatchError, TrainerCheckpointNotFoundError

from .checkpoints import get_last_checkpoint, newer_runs_warning
from .rank_state import group_rank, is_sharded, load_rank_rng, load_replicated, restore_sharded, trainer_group
from .snapshot import restore_rng_state

logger = logging.getLogger("fastckpt.integrations.hf.trainer")


def resume_checkpoint(output_dir: str, resume_from_checkpoint: Any) -> Any:
    """What ``Trainer.train(resume_from_checkpoint=...)`` should get: ``True`` becomes the
    highest-numbered *committed* ``checkpoint-N`` of ``output_dir`` (:func:`get_last_checkpoint`,
    the Trainer's rule minus uncommitted folders), with a WARNING naming lower-numbered checkpoints
    committed after it (it is then probably an earlier run's, :func:`newer_runs_warning`); anything
    else is returned as is.

    Raises:
        TrainerCheckpointNotFoundError: ``True`` and no committed checkpoint exists in
            ``output_dir``: a ``ValueError`` with the Trainer's own message, ``No valid checkpoint
            found in output directory ({output_dir})`` (fix: start without
            ``resume_from_checkpoint`` or pass a checkpoint folder).
    """
    if resume_from_checkpoint is not True:
        return resume_from_checkpoint
    found = get_last_checkpoint(output_dir)
    if found is None:
        # the Trainer's own message, word for word (Trainer.train, transformers 5.24.0): code that
        # matches on it keeps working; the INFO log of get_last_checkpoint names skipped folders
        raise TrainerCheckpointNotFoundError(f"No valid checkpoint found in output directory ({output_dir})")
    newer_runs_warning(output_dir, found)
    return found


#: How many frames above a callback event to look for the Trainer (event -> CallbackHandler.call_event
#: -> CallbackHandler.on_<event> -> Trainer method, plus a little room for wrappers).
_MAX_FRAMES = 12


def find_trainer() -> tuple[Any, Any]:
    """The ``transformers.Trainer`` whose callback event is running, and the
    ``resume_from_checkpoint`` its training loop got, found on the call stack.

    ``TrainerCallback`` events receive neither the Trainer nor the folder a resume loads from; the
    pinned Trainer (transformers 5.24.0) calls ``on_train_begin`` from
    ``Trainer._inner_training_loop(self, ..., resume_from_checkpoint, ...)``, where
    ``resume_from_checkpoint`` is already resolved (``True`` -> the Trainer's
    ``get_last_checkpoint``). Reading that frame is what makes the mixin unnecessary: the callback
    alone restores optimizer, scheduler and RNG from the exact folder, in any ``output_dir``.

    Returns:
        ``(trainer, resume_from_checkpoint)``: ``(None, None)`` when no Trainer frame is found
        within a few frames (events called by hand, a future transformers); ``resume`` is
        ``None`` when the run does not resume.
    """
    frame = _trainer_frame("_inner_training_loop")
    if frame is None:
        return None, None
    return frame.f_locals["self"], frame.f_locals.get("resume_from_checkpoint")


def trainer_being_built() -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` is running (``on_init_end``), or ``None``."""
    frame = _trainer_frame("__init__")
    return None if frame is None else frame.f_locals["self"]


def _trainer_frame(method: str) -> Any:
    """The nearest call-stack frame (within :data:`_MAX_FRAMES`) of ``Trainer.<method>``, or ``None``."""
    import sys

    from transformers import Trainer

    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if isinstance(frame.f_locals.get("self"), Trainer) and frame.f_code.co_name == method:
            return frame
        frame = frame.f_back
    return None


def skip_fsdp_model_load(trainer: Any) -> None:
    """Make ``trainer`` leave a committed fastckpt ``checkpoint-N`` to the callback under FSDP.

    With FSDP the Trainer loads the model itself, before any callback event, through accelerate's
    ``load_fsdp_model``, which reads only its own layout (``pytorch_model_fsdp_0/.metadata`` or
    ``pytorch_model_fsdp.bin``) and raises on a fastckpt folder. The callback fills the sharded
    model in ``on_train_begin`` (``load_into``, any world size), so that load is skipped for
    committed fastckpt folders; every other folder (the Trainer's own checkpoints) loads as before.
    Idempotent."""
    if trainer is None or getattr(trainer, "_fastckpt_fsdp_guard", False):
        return
    import fastckpt

    own = trainer._load_from_checkpoint

    def _load_from_checkpoint(resume_from_checkpoint, model=None):
        if getattr(trainer, "is_fsdp_enabled", False) and fastckpt.is_committed(resume_from_checkpoint):
            return None
        return own(resume_from_checkpoint, model)

    trainer._load_from_checkpoint = _load_from_checkpoint
    trainer._fastckpt_fsdp_guard = True


def _restore_extra_state(model, stored: dict, ckpt: str) -> None:
    """Hand a module's non-tensor ``get_extra_state()`` saved under ``model/<prefix>._extra_state``
    (in ``state.json``) to its ``set_extra_state``: the Trainer loads ``model.safetensors``, tensors
    only, so the resumed run started from the module's initial extra state with no word (a Trainer
    differential probe)."""
    extra = {k: v for k, v in stored.items() if k.endswith("_extra_state") and not isinstance(v, torch.Tensor)}
    if not extra:
        return
    unexpected = model.load_state_dict(extra, strict=False).unexpected_keys
    if unexpected:
        logger.warning("fastckpt: %s holds the extra state of %s, which the model has no module for: not restored",
                       ckpt, ", ".join(unexpected[:4]))


class TrainerResume:
    """The resume half of the Trainer callback: what to restore, and when.

    Call order (from the callback's Trainer events): :meth:`restore` in ``on_train_begin`` (only
    when the Trainer resumed, ``state.global_step > 0``), then :meth:`at_epoch_begin` in every
    ``on_epoch_begin`` and :meth:`at_step_begin` in every ``on_step_begin``; both are no-ops
    once the saved RNG states are restored.
    """

    def __init__(self) -> None:
        self._rng: tuple[str, dict[str, Any]] | None = None  # (when: "epoch" | "epoch+step" | "step", rng)
        self._step_rng: dict[str, Any] | None = None

    def restore(self, ckpt: str, args, state, optimizer, lr_scheduler, model=None, model_state=None) -> bool:
        """Load the optimizer and scheduler states of checkpoint folder ``ckpt`` now and schedule
        its RNG states for the next epoch/step begin.

        Args:
            ckpt: the checkpoint folder the Trainer resumed from.
            args: the ``TrainingArguments`` (``ignore_data_skip``).
            state: the ``TrainerState`` (``global_step`` the Trainer resumed at).
            optimizer, lr_scheduler: the Trainer's (``None`` when absent).
            model, model_state: the live model and the callback's snapshot of it (``state["model"]``
                of :func:`~fastckpt.integrations.hf.snapshot.model_snapshot`); used only when its
                parameters are DTensors (FSDP2): then the model and the optimizer are filled in place
                with :func:`~fastckpt.integrations.hf.rank_state.restore_sharded` (every rank together).

        Returns:
            False, with a WARNING, when ``ckpt`` is not a committed fastckpt checkpoint or holds
            no optimizer/RNG state (``save_only_model``): the resume is then not exact.

        Raises:
            ResumeMismatchError: ``ckpt`` holds another step than ``state.global_step`` (a
                ``ValueError``).
        """
        if not fastckpt.is_committed(ckpt):
            native = [n for n in sorted(os.listdir(ckpt)) if n in ("optimizer.pt", "scheduler.pt")
                      or (n.startswith("rng_state") and n.endswith(".pth"))] if os.path.isdir(ckpt) else []
            if {"optimizer.pt", "scheduler.pt"} <= set(native):  # the Trainer's own checkpoint: restored by the
                # Trainer itself from its pickles (fastckpt reads none of them)
                logger.info("fastckpt: resumed at step %d from the Trainer's own checkpoint %s (optimizer, scheduler "
                            "and RNG restored by the Trainer from %s); the next saves are fastckpt's",
                            state.global_step, ckpt, ", ".join(native))
                return False
            logger.warning(
                "fastckpt: resumed at step %d but %s is not a committed fastckpt checkpoint: optimizer, "
                "scheduler and RNG states come from the Trainer's own files if any; resume may not be "
                "exact (pass FastCkptCallback(resume_from=...))",
                state.global_step, ckpt)
            return False
        rank, world = group_rank(trainer_group(args))
        sharded = is_sharded(model)  # FSDP2: the model and optimizer are read shard by shard below
        snap = load_replicated(ckpt, skip=("model", "adapter", "optimizer") if sharded else ())
        if snap.get("trainer", {}).get("global_step") != state.global_step:
            raise ResumeMismatchError(
                f"{ckpt} holds step {snap.get('trainer', {}).get('global_step')} (manifest key trainer/global_step), "
                f"but the Trainer resumed at step {state.global_step} from its trainer_state.json: resume "
                "from an unmodified fastckpt checkpoint folder")
        if snap.get("trainer", {}).get("save_only_model") or (not sharded and snap.get("optimizer") is None):
            logger.warning("fastckpt: %s has no optimizer/RNG state (save_only_model?): resume is not exact",
                           ckpt)
            return False
        if sharded:
            restore_sharded(ckpt, model, optimizer, model_state)
        elif optimizer is not None:
            optimizer.load_state_dict(snap["optimizer"])
        if not sharded and model is not None:
            _restore_extra_state(model, snap.get("model") or {}, ckpt)
        if lr_scheduler is not None and snap.get("scheduler") is not None:
            lr_scheduler.load_state_dict(snap["scheduler"])
        rng, epoch_rng = load_rank_rng(ckpt, snap, rank, world)
        if rng is None:  # this rank has no saved RNG state (a WARNING said so): it keeps its own
            logger.info("fastckpt: restored optimizer and scheduler from %s (rank %d: RNG not restored)", ckpt, rank)
            return True
        epoch = float(snap["trainer"]["epoch"] or 0.0)
        at_boundary = math.isclose(epoch, round(epoch)) or args.ignore_data_skip
        if at_boundary or epoch_rng is None:
            self._rng = ("epoch", rng)
        else:  # mid-epoch: replay the sampler's shuffle, then continue from the saved RNG
            self._rng = ("epoch+step", epoch_rng)
            self._step_rng = rng
        logger.info("fastckpt: restored optimizer, scheduler and RNG (rank %d) from %s", rank, ckpt)
        return True

    def at_epoch_begin(self) -> None:
        """Restore the RNG state due at this epoch begin, if any (before the sampler draws)."""
        if self._rng is None:
            return
        when, rng = self._rng
        restore_rng_state(rng)
        self._rng = None if when == "epoch" else ("step", self._step_rng)

    def at_step_begin(self) -> None:
        """Restore the saved RNG state at the first step of a run resumed mid-epoch."""
        if self._rng is not None and self._rng[0] == "step":
            restore_rng_state(self._rng[1])
            self._rng = None
