"""accelerate plugin: ``accelerator.save_state()`` / ``load_state()`` through fastckpt.

Usage::

    from fastckpt.integrations import accelerate as fca

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="run", automatic_checkpoint_naming=True, total_limit=3))
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    fca.enable(accelerator, async_save=True)
    accelerator.save_state()        # run/checkpoints/checkpoint_0, atomic, no pickle
    accelerator.load_state()        # newest *committed* checkpoint_N (or a given folder)

``enable`` replaces the two bound methods on this accelerator instance (accelerate's
``register_save_state_pre_hook`` runs before its own pickle writes and cannot replace them).
A checkpoint holds every prepared model (HF layout for the first one: ``model-*.safetensors`` +
index + ``config.json``; ``model_1`` ... for more), every optimizer and scheduler, the
GradScaler, registered custom objects (``accelerator.register_for_checkpointing``), the
Python/NumPy/torch/CUDA RNG states, ``accelerator.step``, the epoch of seedable samplers and each
prepared dataloader's ``iteration`` and shuffle generator (``synchronized_generator``).
With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` folders are
``project_dir/checkpoints/checkpoint_<iteration>`` and ``total_limit`` keeps the newest committed
ones (the newest committed is never deleted).

Several processes (DDP, ``accelerate launch``): every rank calls ``save_state``/``load_state``
(they are collective). Only the main process writes, alone (no ``process_group``): rank-0
model/optimizer state (DDP replicas are identical) plus every rank's RNG state, gathered to it
(``rng_per_process``); on load each rank reads the folder and restores its own RNG state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import fastckpt
from fastckpt.storage import prune_checkpoints, step_folders

from .hf_snapshot import capture_rng_state, dedup_tied, restore_rng_state

logger = logging.getLogger(__name__)

_AUTO_PREFIX = "checkpoint_"  # accelerate's automatic_checkpoint_naming: checkpoints/checkpoint_<iteration>


class FastCkptState:
    """The fastckpt ``save_state``/``load_state`` pair bound to one accelerator.

    Args:
        accelerator: a prepared ``accelerate.Accelerator``.
        async_save: return right after staging and write in the background (default False);
            the pending save is awaited before the next save/load and by :meth:`wait`.
        **save_options: passed on to :func:`fastckpt.async_save`.
    """

    def __init__(self, accelerator, *, async_save: bool = False, **save_options):
        self.acc = accelerator
        self.async_save = async_save
        self.save_options = save_options
        self._saver = fastckpt.Saver()  # this plugin's own: another accelerator's failure never surfaces here
        self._pending = None
        self.records: list[dict[str, Any]] = []

    # -- state ---------------------------------------------------------------------------------
    def _snapshot(self) -> tuple[dict, dict, dict]:
        acc = self.acc
        state: dict[str, Any] = {}
        weights: dict[str, str] = {}
        extra: dict[str, bytes] = {}
        for i, model in enumerate(acc._models):
            key = "model" if i == 0 else f"model_{i}"
            sd = acc.unwrap_model(model).state_dict()
            state[key] = dedup_tied(sd)
            weights[key] = key
            cfg = getattr(acc.unwrap_model(model), "config", None)
            if i == 0 and cfg is not None and hasattr(cfg, "to_json_string"):
                extra["config.json"] = cfg.to_json_string().encode()
        state["optimizers"] = [o.state_dict() for o in acc._optimizers]
        state["schedulers"] = [s.state_dict() for s in acc._schedulers]
        state["custom"] = [o.state_dict() for o in acc._custom_objects]
        state["scaler"] = acc.scaler.state_dict() if acc.scaler is not None else None
        state["samplers"] = [self._sampler_state(dl) for dl in acc._dataloaders]
        state["rng"] = capture_rng_state()
        state["step"] = int(acc.step)
        return state, weights, extra

    @staticmethod
    def _sampler_state(dl) -> dict | None:
        out: dict[str, Any] = {}
        sampler = getattr(getattr(dl, "batch_sampler", None), "sampler", None) or getattr(dl, "sampler", None)
        if sampler is not None and hasattr(sampler, "epoch"):
            out["epoch"] = int(sampler.epoch)
        if isinstance(getattr(dl, "iteration", None), int):  # accelerate's epoch counter (set_epoch)
            out["iteration"] = dl.iteration
        gen = getattr(dl, "synchronized_generator", None)  # the shuffle generator accelerate syncs
        if gen is not None:
            out["generator"] = gen.get_state()
        return out or None

    # -- save ----------------------------------------------------------------------------------
    def _target(self, output_dir) -> Path:
        cfg = self.acc.project_configuration
        if cfg.automatic_checkpoint_naming:
            root = Path(self.acc.project_dir) / "checkpoints"
            out = root / f"checkpoint_{cfg.iteration}"
            if out.exists():
                raise FileExistsError(
                    f"{out} already exists; set accelerator.project_configuration.iteration to the next number")
            return out
        if output_dir is None:
            raise ValueError("save_state() needs output_dir unless automatic_checkpoint_naming=True")
        return Path(output_dir)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **_unused) -> str:
        """Save everything ``accelerator.save_state`` saves, through fastckpt.

        Returns:
            The checkpoint folder (committed unless ``async_save``; then after :meth:`wait`).

        Raises:
            FileExistsError: the automatic folder already exists (accelerate's rule).
            ValueError: no ``output_dir`` and automatic naming is off.
            The previous asynchronous save's own exception, if it failed.
        """
        self.wait()
        multi = self._distributed()
        if multi:  # every rank checks the target before the main process creates it
            self.acc.wait_for_everyone()
        out = self._target(output_dir)
        cfg = self.acc.project_configuration
        rngs = self._gather_rng() if multi else None  # collective: before the main-only branch
        if self.acc.is_main_process:
            out.parent.mkdir(parents=True, exist_ok=True)
            state, weights, extra = self._snapshot()
            if rngs is not None:
                state["rng_per_process"] = rngs
            # no process_group: the main process writes alone
            fut = self._saver.async_save(state, out, overwrite=not cfg.automatic_checkpoint_naming,
                                         weights=weights, extra_files=extra, **self.save_options)
            self._pending = (fut, out)
            if not self.async_save:
                self.wait()
        self.acc.wait_for_everyone()
        cfg.iteration += 1
        return str(out)

    def _distributed(self) -> bool:
        import torch.distributed as dist

        return self.acc.num_processes > 1 and dist.is_available() and dist.is_initialized()

    @staticmethod
    def _gather_rng() -> list[dict[str, Any]]:
        """Every rank's :func:`capture_rng_state`, in rank order (collective)."""
        import torch.distributed as dist

        rngs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, capture_rng_state())
        return rngs

    def wait(self) -> None:
        """Block until the pending save is committed, then apply ``total_limit``.

        Raises:
            The background save's own exception (original type).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        fut, out = pending
        fut.result()
        self.records.append({"path": str(out), "blocking_s": getattr(fut, "blocking_s", None),
                             "total_s": getattr(fut, "total_s", None),
                             "bytes": getattr(fut, "bytes_written", None)})
        self._rotate()

    def _rotate(self) -> None:
        """Apply ``total_limit``: keep the newest committed ``checkpoint_N`` folders (the newest
        always), deleting the others through :func:`fastckpt.storage.prune_checkpoints` (which
        first removes dead writers' leftovers, e.g. a deletion interrupted by a crash)."""
        cfg = self.acc.project_configuration
        if not (cfg.automatic_checkpoint_naming and cfg.total_limit):
            return
        root = Path(self.acc.project_dir) / "checkpoints"
        for step in prune_checkpoints(root, _AUTO_PREFIX, cfg.total_limit):
            logger.info("fastckpt: deleted %s (total_limit=%d)", root / f"{_AUTO_PREFIX}{step}", cfg.total_limit)

    # -- load ----------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """Newest committed ``checkpoint_N`` under ``project_dir/checkpoints`` (others are logged)."""
        for n, p in reversed(step_folders(Path(self.acc.project_dir) / "checkpoints", _AUTO_PREFIX)):
            if fastckpt.is_committed(p):
                return p
            logger.info("fastckpt: skipping %s: no committed fastckpt manifest", p)
        return None

    def load_state(self, input_dir: str | os.PathLike | None = None, **_unused) -> None:
        """Restore everything :meth:`save_state` wrote (bit-exact), in place.

        Raises:
            fastckpt.errors.CheckpointNotFoundError: no committed checkpoint to load.
            ValueError: the checkpoint holds a different number of models/optimizers/...
        """
        self.wait()
        acc = self.acc
        if self._distributed():  # the main process's pending save is committed for every rank
            acc.wait_for_everyone()
        if input_dir is None:
            if not acc.project_configuration.automatic_checkpoint_naming:
                raise ValueError("load_state() needs input_dir unless automatic_checkpoint_naming=True")
            input_dir = self.latest()
            if input_dir is None:
                raise fastckpt.CheckpointNotFoundError(
                    f"no committed checkpoint under {Path(acc.project_dir) / 'checkpoints'}")
        snap = fastckpt.load(input_dir)
        for name, live in (("optimizers", acc._optimizers), ("schedulers", acc._schedulers),
                           ("custom", acc._custom_objects)):
            if len(snap[name]) != len(live):
                raise ValueError(f"{input_dir} holds {len(snap[name])} {name}, the accelerator has {len(live)}")
        for i, model in enumerate(acc._models):
            acc.unwrap_model(model).load_state_dict(snap["model" if i == 0 else f"model_{i}"], strict=False)
        for o, s in zip(acc._optimizers, snap["optimizers"]):
            o.load_state_dict(s)
        for o, s in zip(acc._schedulers, snap["schedulers"]):
            o.load_state_dict(s)
        for o, s in zip(acc._custom_objects, snap["custom"]):
            o.load_state_dict(s)
        if acc.scaler is not None and snap.get("scaler") is not None:
            acc.scaler.load_state_dict(snap["scaler"])
        for dl, s in zip(acc._dataloaders, snap.get("samplers", [])):
            sampler = getattr(getattr(dl, "batch_sampler", None), "sampler", None) or getattr(dl, "sampler", None)
            if s and "epoch" in s and sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(s["epoch"])
            if s and "iteration" in s and hasattr(dl, "set_epoch"):
                dl.set_epoch(s["iteration"])
            if s and "generator" in s and getattr(dl, "synchronized_generator", None) is not None:
                dl.synchronized_generator.set_state(s["generator"].cpu())
        acc.step = int(snap["step"])
        per_rank = snap.get("rng_per_process")
        if per_rank is not None and len(per_rank) == acc.num_processes:
            restore_rng_state(per_rank[acc.process_index])
        else:
            if per_rank is not None or acc.num_processes > 1:
                logger.warning("fastckpt: %s holds RNG states of %s processes, this run has %d: "
                               "every rank gets the main process's RNG state (resume not exact)",
                               input_dir, len(per_rank) if per_rank is not None else 1,
                               acc.num_processes)
            restore_rng_state(snap["rng"])
        logger.info("fastckpt: loaded state from %s", input_dir)


def enable(accelerator, *, async_save: bool = False, **save_options) -> FastCkptState:
    """Make ``accelerator.save_state`` / ``load_state`` write and read through fastckpt.

    Args:
        accelerator: an ``accelerate.Accelerator`` (call after ``prepare`` or before; the lists
            of prepared objects are read at save time).
        async_save: stage and return; write in the background (default False).
        **save_options: ``max_shard_bytes``, ``threads``, ``staging_bytes``, ``o_direct``.

    Returns:
        The :class:`FastCkptState` now bound as ``accelerator.save_state``/``load_state``; call
        its ``wait()`` before exiting when ``async_save=True``.

    Raises:
        NotImplementedError: DeepSpeed, FSDP or Megatron-LM accelerators (their engines own
            checkpointing; use fastckpt's DeepSpeed integration instead).
    """
    kind = str(getattr(accelerator, "distributed_type", ""))
    if any(k in kind for k in ("DEEPSPEED", "FSDP", "MEGATRON")):
        raise NotImplementedError(f"fastckpt accelerate plugin does not handle {kind}")
    plugin = FastCkptState(accelerator, async_save=async_save, **save_options)
    accelerator.save_state = plugin.save_state
    accelerator.load_state = plugin.load_state
    accelerator.fastckpt = plugin
    return plugin
