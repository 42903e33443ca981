"""``checkpoint-N`` folders of a Trainer run: find the newest committed one, rotate old ones,
and the Trainer's bookkeeping the callback mirrors (best metric, logged steps).

Used by :mod:`fastckpt.integrations.hf_trainer` (which re-exports the public names).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

import fastckpt
from fastckpt.storage import prune_checkpoints, scan_checkpoints, step_folders

logger = logging.getLogger("fastckpt.integrations.hf_trainer")

PREFIX_CHECKPOINT_DIR = "checkpoint"
_PREFIX = f"{PREFIX_CHECKPOINT_DIR}-"


def get_last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Return the newest *committed* fastckpt ``checkpoint-N`` folder in ``output_dir``.

    Unlike ``transformers.trainer_utils.get_last_checkpoint`` (highest number, unchecked),
    folders without a committed fastckpt manifest (e.g. left by a crashed plain-Trainer save)
    are skipped with an INFO log line naming them.

    Returns:
        The folder path as ``str`` (what ``trainer.train(resume_from_checkpoint=...)`` takes),
        or None when there is none.
    """
    for step, path in reversed(step_folders(output_dir, _PREFIX)):
        if fastckpt.is_committed(path):
            return str(path)
        logger.info("fastckpt: skipping %s (step %d): no committed fastckpt manifest", path, step)
    return None


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None,
                       best_model_checkpoint: str | None = None) -> list[Path]:
    """Delete the oldest committed checkpoints beyond ``save_total_limit``.

    The Trainer's rule (``Trainer._rotate_checkpoints``): ``save_total_limit`` folders remain,
    the best one counted among them; never deletes the newest committed checkpoint or
    ``best_model_checkpoint`` (with a limit of 1 and a different best, two are kept, as the
    Trainer does); uncommitted folders are left alone. Each victim goes through
    :func:`fastckpt.storage.retention.delete_checkpoint` (renamed to a temporary name that the
    next save's cleanup or ``fastckpt prune`` removes if this process dies mid-deletion), after
    dead writers' leftovers in ``output_dir`` are removed.

    Args:
        output_dir: the Trainer's ``args.output_dir``.
        save_total_limit: ``args.save_total_limit``; ``None`` or <= 0 deletes nothing.
        best_model_checkpoint: ``state.best_model_checkpoint`` (a folder path) or ``None``.

    Returns:
        The folders deleted, oldest first.

    Raises:
        OSError: a victim could not be renamed.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    scan = scan_checkpoints(output_dir, _PREFIX)
    best = Path(best_model_checkpoint).resolve() if best_model_checkpoint else None
    best_step = next((s for s, p in scan.committed if best is not None and p.resolve() == best), None)
    keep = save_total_limit
    if best_step is not None and best_step not in scan.steps[-keep:]:
        keep = max(1, keep - 1)  # the best counts among the limit (the Trainer keeps limit folders)
    protect = () if best_step is None else (best_step,)
    deleted = [scan.root / f"{_PREFIX}{s}" for s in prune_checkpoints(output_dir, _PREFIX, keep, protect)]
    for p in deleted:
        logger.info("fastckpt: deleted %s (save_total_limit=%d)", p, save_total_limit)
    return deleted


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
        state.best_global_step = state.global_step
        return True
    return False
