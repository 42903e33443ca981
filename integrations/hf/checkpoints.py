"""``checkpoint-N`` folders of a Trainer run: find the newest committed one, rotate old ones,
and the Trainer's bookkeeping the callback mirrors (best metric, logged steps).

Used by :mod:`fastckpt.integrations.hf.trainer` (which re-exports the public names).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import numpy as np

import fastckpt
from fastckpt.storage import scan_checkpoints, step_folders
from fastckpt.storage.retention import prune_checkpoints

logger = logging.getLogger("fastckpt.integrations.hf.trainer")

PREFIX_CHECKPOINT_DIR = "checkpoint"
_PREFIX = f"{PREFIX_CHECKPOINT_DIR}-"


def trainers_own(path: str | os.PathLike) -> bool:
    """True for a ``checkpoint-N`` folder the Trainer wrote by itself, whole: it holds
    ``trainer_state.json``, which ``Trainer._save_checkpoint`` writes after the model, optimizer
    and scheduler (a run before the callback was added)."""
    return os.path.isfile(os.path.join(path, "trainer_state.json"))


def get_last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Return the newest ``checkpoint-N`` folder of ``output_dir`` to resume from: committed by
    fastckpt, or written whole by the Trainer itself (:func:`trainers_own`; the resume restores it
    as the Trainer does).

    Unlike ``transformers.trainer_utils.get_last_checkpoint`` (highest number, unchecked),
    other folders (a save that crashed) are skipped with an INFO log line naming them.

    Returns:
        The folder path as ``str`` (what ``trainer.train(resume_from_checkpoint=...)`` takes),
        or None when there is none.
    """
    for step, path in reversed(step_folders(output_dir, _PREFIX)):
        if fastckpt.is_committed(path) or trainers_own(path):
            return str(path)
        logger.info("fastckpt: skipping %s (step %d): no committed fastckpt manifest", path, step)
    return None


def foreign_checkpoints_ahead(output_dir: str | os.PathLike, start: int, end: int, every: int | None) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir`` that fastckpt did not commit (the Trainer's own,
    a crashed save) at a step this run will save at: ``start < N <= end`` and ``N`` a multiple of
    ``every`` (``None``: any step) or ``N == end``. A save never writes into another writer's folder
    (``CheckpointExistsError``), so a run over one would fail there, after training up to it."""
    return [p for n, p in step_folders(output_dir, _PREFIX)
            if start < n <= end and (not every or n % every == 0 or n == end) and not fastckpt.is_committed(p)
            and os.path.isdir(p) and os.listdir(p)]


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None,
                       best_model_checkpoint: str | None = None,
                       just_saved: str | os.PathLike | None = None) -> list[Path]:
    """Delete old committed checkpoints beyond ``save_total_limit``, by the pinned Trainer's rule.

    The rule of ``transformers.trainer_utils.rotate_checkpoints`` as ``Trainer._save_checkpoint``
    calls it (transformers 5.24.0, ``use_mtime=True``): checkpoints are ordered by commit time
    (folder mtime; by step when all lie within 1 s, see
    :func:`fastckpt.storage.retention.commit_order`), the most recent one and
    ``best_model_checkpoint`` are protected and count among the limit, the oldest others go.
    Two differences, both for safety: ``just_saved`` (the folder just committed) is protected too,
    so a save is never rotated away by higher-numbered checkpoints of an earlier run in the same
    ``output_dir`` (transformers#26961; the Trainer itself deletes it when the mtimes lie within
    1 s); and only committed fastckpt folders count and are deleted (a ``checkpoint-N`` folder
    without a committed manifest, e.g. a plain Trainer's, is left alone). A deleted checkpoint
    with a higher step than ``just_saved`` (an earlier run's) is named in a WARNING.

    Each victim goes through :func:`fastckpt.storage.retention.delete_checkpoint` (renamed to a
    temporary name that the next save's cleanup or ``fastckpt prune`` removes if this process
    dies mid-deletion), after dead writers' leftovers in ``output_dir`` are removed.

    Args:
        output_dir: the Trainer's ``args.output_dir``.
        save_total_limit: ``args.save_total_limit``; ``None`` or <= 0 deletes nothing.
        best_model_checkpoint: ``state.best_model_checkpoint`` (a folder path) or ``None``.
        just_saved: the checkpoint folder just committed, or ``None``.

    Returns:
        The folders deleted, oldest commit first.

    Raises:
        OSError: a victim could not be renamed.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    scan = scan_checkpoints(output_dir, _PREFIX)
    protect = []
    for folder in (best_model_checkpoint, just_saved):
        if folder:
            protect += [s for s, p in scan.committed if p.resolve() == Path(folder).resolve()]
    steps = prune_checkpoints(output_dir, _PREFIX, save_total_limit, tuple(protect), by_commit_time=True)
    deleted = [scan.root / f"{_PREFIX}{s}" for s in steps]
    mine = protect[-1] if just_saved and protect else None
    for s, p in zip(steps, deleted):
        if mine is not None and s > mine:
            logger.warning("fastckpt: deleted %s (save_total_limit=%d): committed before %s%d, so an earlier "
                           "run's checkpoint; the Trainer rotates by commit time too", p, save_total_limit,
                           _PREFIX, mine)
        else:
            logger.info("fastckpt: deleted %s (save_total_limit=%d)", p, save_total_limit)
    return deleted


def newer_runs_warning(output_dir: str | os.PathLike, chosen: str | os.PathLike) -> list[Path]:
    """Warn when ``chosen`` (the checkpoint a resume picked by highest step, as the Trainer's
    ``get_last_checkpoint`` does) was committed before lower-numbered checkpoints of
    ``output_dir``: it is then probably an earlier run's.

    Returns:
        The lower-numbered, later-committed folders named in the WARNING (empty: no warning).
    """
    chosen = Path(os.path.abspath(os.fspath(chosen)))
    m = re.fullmatch(re.escape(_PREFIX) + r"(\d+)", chosen.name)
    if m is None or chosen.parent != Path(os.path.abspath(os.fspath(output_dir))):
        return []
    step = int(m.group(1))
    try:
        at = chosen.stat().st_mtime
        later = [p for s, p in scan_checkpoints(output_dir, _PREFIX).committed
                 if s < step and p.stat().st_mtime > at]
    except OSError:
        return []
    if later:
        logger.warning("fastckpt: resuming from %s, the highest step in %s (the Trainer's rule), but it was "
                       "committed before %s: it is probably an earlier run's checkpoint. Pass "
                       "resume_from_checkpoint=<folder> to resume this run instead", chosen, output_dir,
                       ", ".join(p.name for p in later))
    return later


def logged_this_step(state) -> bool:
    """True if ``state.log_history`` (a ``TrainerState``'s) already has the training log entry
    (one with ``loss``) of ``state.global_step``; looks at the last 4 entries only."""
    return any(h.get("step") == state.global_step and "loss" in h for h in state.log_history[-4:])


def update_best_metric(args, state, metrics: dict[str, float]) -> bool:
    """Mirror of ``Trainer._determine_best_metric``: update ``state.best_metric`` and
    ``state.best_global_step`` from ``metrics`` and return whether this evaluation is a new best.

    Args:
        args: the ``TrainingArguments`` (``metric_for_best_model``, ``greater_is_better``).
        state: the ``TrainerState`` (updated in place).
        metrics: evaluation metrics (``eval_``-prefixed names).

    Returns:
        False when no ``metric_for_best_model`` is set or the value is not better.

    Raises:
        KeyError: the metric is not in ``metrics`` (names the ones there are).
    """
    name = args.metric_for_best_model
    if not name:
        return False
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        raise KeyError(f"metric_for_best_model '{key}' not in evaluation metrics {sorted(metrics)}")
    value = metrics[key]
    better = np.greater if args.greater_is_better else np.less
    if state.best_metric is None:
        state.best_metric = float("-inf") if args.greater_is_better else float("inf")
    if better(value, state.best_metric):
        state.best_metric = value
        if args.save_strategy in ("steps", "epoch", "best"):  # as the Trainer: no checkpoint step otherwise
            state.best_global_step = state.global_step
        return True
    return False


@contextlib.contextmanager
def scheduler_as_after_evaluate(args, scheduler, optimizer, metrics: dict[str, float]):
    """Inside: ``scheduler`` (and the optimizer's learning rates) as ``Trainer._evaluate`` leaves them
    after this evaluation, for a snapshot taken in ``on_evaluate``; restored on exit, so the Trainer's
    own step right after gives the same values. Only for schedulers the Trainer steps with the metric
    (``ReduceLROnPlateau``, transformers' ``GreedyLR``: ``step(metrics[eval_<metric_for_best_model>])``);
    a missing metric, or a tensor learning rate (changed in place, so a snapshot would not keep it),
    leaves everything as it is (the Trainer then raises its own KeyError)."""
    import copy

    import torch
    kinds = (torch.optim.lr_scheduler.ReduceLROnPlateau,)
    try:
        from transformers.optimization import GreedyLR
        kinds += (GreedyLR,)
    except ImportError:
        pass
    name = args.metric_for_best_model or ""
    key = name if name.startswith("eval_") else f"eval_{name}"
    groups = getattr(optimizer, "param_groups", None) or []
    if not isinstance(scheduler, kinds) or key not in metrics or \
            any(isinstance(g.get("lr"), torch.Tensor) for g in groups):
        yield
        return
    before = copy.deepcopy(scheduler.state_dict())
    lrs = [g["lr"] for g in groups]
    scheduler.step(metrics[key])
    try:
        yield
    finally:
        scheduler.load_state_dict(before)
        for g, lr in zip(groups, lrs):
            g["lr"] = lr


def update_stateful_callbacks(state, callbacks, control) -> None:
    """Refresh ``state.stateful_callbacks`` (a ``TrainerState``'s) from every
    ``transformers.trainer_callback.ExportableState`` among ``callbacks`` (the Trainer's callbacks)
    and ``control`` (its ``TrainerControl``), grouped by class name, as ``Trainer._save_checkpoint``
    does. ``control`` is recorded with ``should_save=True``, as the Trainer's own save records it
    (the fastckpt callback has set it to False to keep the Trainer from saving)."""
    import copy

    from transformers.trainer_callback import ExportableState

    control = copy.copy(control)
    control.should_save = True
    grouped: dict[str, list] = {}
    for cb in list(callbacks) + [control]:
        if isinstance(cb, ExportableState):
            grouped.setdefault(cb.__class__.__name__, []).append(cb.state())
    for name, states in grouped.items():
        state.stateful_callbacks[name] = states if len(states) > 1 else states[0]


def is_trainers_last(output_dir: str | os.PathLike, ckpt: str | os.PathLike) -> bool:
    """True if ``ckpt`` is the folder the Trainer's own ``get_last_checkpoint(output_dir)``
    (``transformers.trainer_utils``, highest ``checkpoint-N``, committed or not) picks, i.e. the
    one ``train(resume_from_checkpoint=True)`` resumes from without the mixin."""
    from transformers.trainer_utils import get_last_checkpoint as trainers_last

    try:
        last = trainers_last(output_dir)
    except OSError:
        return False
    return last is not None and os.path.abspath(last) == os.path.abspath(ckpt)
