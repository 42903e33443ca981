"""``checkpoint-N`` folders of a Trainer run: find the newest committed one, rotate old ones,
and the Trainer's bookkeeping the callback mirrors (best metric, logged steps).

Used by :mod:`fastckpt.integrations.hf_trainer` (which re-exports the public names).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np

import fastckpt

logger = logging.getLogger("fastckpt.integrations.hf_trainer")

PREFIX_CHECKPOINT_DIR = "checkpoint"
_CKPT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def get_last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Return the newest *committed* fastckpt ``checkpoint-N`` folder in ``output_dir``.

    Unlike ``transformers.trainer_utils.get_last_checkpoint`` (highest number, unchecked),
    folders without a committed fastckpt manifest (e.g. left by a crashed plain-Trainer save)
    are skipped with an INFO log line naming them.

    Returns:
        The folder path as ``str`` (what ``trainer.train(resume_from_checkpoint=...)`` takes),
        or None when there is none.
    """
    for step, path in reversed(_checkpoint_dirs(output_dir)):
        if fastckpt.is_committed(path):
            return str(path)
        logger.info("fastckpt: skipping %s (step %d): no committed fastckpt manifest", path, step)
    return None


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None,
                       best_model_checkpoint: str | None = None) -> list[Path]:
    """Delete the oldest committed checkpoints beyond ``save_total_limit``.

    Never deletes the newest committed checkpoint or ``best_model_checkpoint`` (with a limit of
    1 and a different best, two are kept, as the Trainer does); uncommitted folders are left
    alone. Each victim is first renamed to a hidden name so it never looks half-deleted.

    Returns:
        The folders deleted.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    committed = [p for _, p in _checkpoint_dirs(output_dir) if fastckpt.is_committed(p)]
    best = Path(best_model_checkpoint).resolve() if best_model_checkpoint else None
    limit = save_total_limit
    if best is not None and limit == 1 and committed and committed[-1].resolve() != best:
        limit = 2
    victims = [p for p in committed[:-1] if p.resolve() != best][: max(0, len(committed) - limit)]
    for p in victims:
        hidden = p.with_name(f".{p.name}.deleting-{os.getpid()}")
        os.rename(p, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        logger.info("fastckpt: deleted %s (save_total_limit=%d)", p, save_total_limit)
    return victims


def _logged(state) -> bool:
    """True if ``state.log_history`` already has the training log entry of the current step."""
    return any(h.get("step") == state.global_step and "loss" in h for h in state.log_history[-4:])


def _new_best(args, state, metrics: dict[str, float]) -> bool:
    """Mirror of ``Trainer._determine_best_metric``; updates ``state`` and returns is-new-best."""
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
