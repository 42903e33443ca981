"""accelerate plugin: ``accelerator.save_state()`` / ``load_state()`` through fastckpt.

Usage::

    from fastckpt.integrations.accelerate import plugin as fca

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="run", automatic_checkpoint_naming=True, total_limit=3))
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    fca.enable(accelerator, async_save=True)
    accelerator.save_state()        # run/checkpoints/checkpoint_0, atomic, no pickle
    accelerator.load_state()        # newest *committed* checkpoint_N (or a given folder)

``enable`` replaces the two bound methods on this accelerator instance and keeps accelerate's
contracts (accelerate 1.15.0, ``Accelerator.save_state``/``load_state``):

- pre-hooks (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``) run with the
  same arguments and at the same point; what a save hook writes into ``output_dir`` is committed
  with the checkpoint (see :func:`~fastckpt.integrations.accelerate.state.run_save_hooks`);
- a stateful dataloader (``DataLoaderConfiguration(use_stateful_dataloader=True)``) resumes at
  its position inside the epoch;
- models load with ``strict=True`` unless ``load_state(..., strict=False)``; ``map_location``
  (``None``/``"cpu"``/``"on_device"``) and ``load_kwargs`` are honoured;
- automatic naming ``project_dir/checkpoints/checkpoint_<iteration>`` continues after
  ``load_state`` from the loaded iteration; ``total_limit`` keeps the newest committed folders and
  never the one just saved; an existing target raises ``ValueError``
  (:class:`~fastckpt.errors.AccelerateStateError`) like accelerate;
- ``register_for_checkpointing`` objects, ``save_on_each_node`` (each node's local main process
  writes its copy).

A checkpoint holds every prepared model (HF layout for the first one: ``model.safetensors``, or
``model-*.safetensors`` + index past one shard, + ``config.json``; ``model_1`` ... for more), every optimizer and scheduler, the
GradScaler, registered custom objects, the Python/NumPy/torch/CUDA RNG states,
``accelerator.step``, the automatic-naming iteration, and each prepared dataloader's position.

Each plugin owns its :class:`fastckpt.Saver`: accelerator A's failed asynchronous save surfaces in
A's next ``save_state``/``load_state``/``wait``, never in B's. A save still pending at interpreter
exit is finished before the process ends (a failed one prints an error and exits with status 1).

Several processes (DDP, ``accelerate launch``): every rank calls ``save_state``/``load_state``
(they are collective). Only the main process writes, alone (no ``process_group``): rank-0
model/optimizer state (DDP replicas are identical) plus every rank's RNG state, gathered to it
(``rng_per_process``); on load each rank reads the folder and restores its own RNG state.
FSDP2 (models with DTensor parameters): every rank writes its shards of one HF-layout
checkpoint and reads back only its own regions, at any world size
(:mod:`~fastckpt.integrations.accelerate.fsdp2`); FSDP1 raises ``AccelerateFSDP1Error``.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path
from typing import Any, Callable

import fastckpt
from fastckpt.errors import AccelerateCheckpointNotFoundError, AccelerateStateError
from fastckpt.storage import prune_checkpoints, step_folders

from . import fsdp2 as dt
from . import state as st
from ..hf.snapshot import ModelFilesCache, capture_rng_state, dedup_tied, restore_rng_state

logger = logging.getLogger(__name__)

_AUTO_PREFIX = "checkpoint_"  # accelerate's automatic_checkpoint_naming: checkpoints/checkpoint_<iteration>
#: Every live plugin of this process: a load waits for another plugin's pending save of the same
#: folder (without taking its error, which stays with that plugin).
_LIVE: "weakref.WeakSet[FastCkptState]" = weakref.WeakSet()


class FastCkptState:
    """The fastckpt ``save_state``/``load_state`` pair bound to one accelerator.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        async_save: return right after staging and write in the background (default False);
            the pending save is awaited before the next save/load and by :meth:`wait`.
        **save_options: passed on to :func:`fastckpt.async_save`.
    """

    def __init__(self, accelerator, *, async_save: bool = False, **save_options):
        self.acc = accelerator
        self.async_save = async_save
        self.save_options = save_options
        self._saver = fastckpt.Saver()  # this plugin's own: another accelerator's failure never surfaces here
        self._pending: tuple[Any, Path] | None = None
        self._model_files = ModelFilesCache()  # config.json as save_pretrained writes it, built once
        self._rotate_error: BaseException | None = None
        self.records: list[dict[str, Any]] = []
        _LIVE.add(self)

    # -- save ----------------------------------------------------------------------------------
    def _root(self) -> Path:
        return Path(os.path.abspath(os.path.join(self.acc.project_dir, "checkpoints")))

    def _target(self, output_dir) -> Path:
        cfg = self.acc.project_configuration
        if cfg.automatic_checkpoint_naming:
            out = self._root() / f"{_AUTO_PREFIX}{cfg.iteration}"
            if out.exists():
                raise AccelerateStateError(
                    f"Checkpoint directory {out} ({cfg.iteration}) already exists. Set "
                    f"accelerator.project_configuration.iteration to the next free number, or load_state() "
                    f"that checkpoint first (numbering then continues after it)")
            return out
        if output_dir is None:
            raise AccelerateStateError("save_state() needs output_dir unless "
                                       "ProjectConfiguration(automatic_checkpoint_naming=True)")
        return Path(os.path.abspath(os.path.expanduser(os.fspath(output_dir))))

    def _writes(self) -> bool:
        """The main process writes; with ``save_on_each_node`` each node's local main process."""
        if self.acc.project_configuration.save_on_each_node:
            return self.acc.is_local_main_process
        return self.acc.is_main_process

    def _snapshot(self, weights: list[dict], originals: list[dict]) -> tuple[dict, dict, dict]:
        acc = self.acc
        state: dict[str, Any] = {}
        names: dict[str, str] = {}
        extra: dict[str, bytes] = {}
        for i, sd in enumerate(weights):  # what the pre-hooks left, saved by position like accelerate
            key = st.model_key(i)
            state[key] = dedup_tied(sd)
            names[key] = key
        if weights and originals and weights[0] is originals[0]:
            extra.update(self._config_file())
        state["optimizers"] = [o.state_dict() for o in acc._optimizers]
        state.update(self._objects())
        state["samplers"] = [st.dataloader_state(dl) for dl in acc._dataloaders]
        state["rng"] = capture_rng_state()
        if not acc.project_configuration.automatic_checkpoint_naming:
            del state["iteration"]
        return state, names, extra

    def _objects(self) -> dict[str, Any]:
        """Schedulers, registered objects, GradScaler, ``step`` and the automatic-naming iteration
        (``None`` when automatic naming is off): equal on every rank."""
        acc = self.acc
        cfg = acc.project_configuration
        return {"schedulers": [s.state_dict() for s in acc._schedulers],
                "custom": [o.state_dict() for o in acc._custom_objects],
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                "step": int(acc.step),
                "iteration": int(cfg.iteration) if cfg.automatic_checkpoint_naming else None}

    def _config_file(self) -> dict[str, bytes]:
        """``config.json`` of the first model when it has an HF config (from_pretrained reads the folder)."""
        model = self.acc.unwrap_model(self.acc._models[0]) if self.acc._models else None
        if model is None or getattr(model, "config", None) is None:
            return {}
        return {"config.json": self._model_files(model)["config.json"]}  # as save_pretrained writes it

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> Path:
        """Save everything ``accelerator.save_state`` saves, through fastckpt (atomic commit).

        Args:
            output_dir: the checkpoint folder; ignored with automatic naming
                (``project_dir/checkpoints/checkpoint_<iteration>``), like accelerate.
            safe_serialization: accepted for accelerate's signature; weights are always
                safetensors and nothing is pickled.
            **save_model_func_kwargs: accelerate hands these to DeepSpeed only (not supported here).

        Returns:
            The checkpoint folder as a ``pathlib.Path``, as accelerate's ``save_state`` returns it
            (committed unless ``async_save``; then after :meth:`wait`).

        Raises:
            AccelerateStateError: (a ``ValueError``, like accelerate) the automatic folder already
                exists, or no ``output_dir`` while automatic naming is off.
            The previous asynchronous save's own exception, if it failed; a pre-hook's exception.
        """
        self.wait()
        acc = self.acc
        multi = self._distributed()
        if multi:  # every rank checks the target before the main process creates it
            acc.wait_for_everyone()
        out = self._target(output_dir)
        cfg = acc.project_configuration
        if dt.sharded(acc):  # FSDP2: every rank saves its shards (integrations/accelerate/fsdp2.py)
            self._save_sharded(out, multi)
            acc.wait_for_everyone()
            cfg.iteration += 1
            return out
        rngs = dt.gather(capture_rng_state()) if multi else None  # collective: before the main-only branch
        weights = st.model_weights(acc)
        originals = list(weights)
        hook_files = st.run_save_hooks(acc, weights, out.name)  # on every rank, as accelerate
        if self._writes():
            state, names, extra = self._snapshot(weights, originals)
            st.check_hook_files(hook_files, [*names, "state"])  # "state": the non-weight shards (docs/FORMAT.md)
            extra.update(hook_files)
            if rngs is not None:
                state["rng_per_process"] = rngs
            self._start(state, out, names, extra)  # no process_group: the writing process writes alone
        acc.wait_for_everyone()
        cfg.iteration += 1
        return out

    def _start(self, state: dict, out: Path, names: dict, extra: dict) -> None:
        """Start the save of ``state`` to ``out`` (waited for unless ``async_save``)."""
        cfg = self.acc.project_configuration
        out.parent.mkdir(parents=True, exist_ok=True)
        step = cfg.iteration if cfg.automatic_checkpoint_naming else None
        opts = dict(self.save_options)
        opts["on_commit"] = self._after_commit(step, opts.get("on_commit"))
        fut = self._saver.async_save(state, out, overwrite=not cfg.automatic_checkpoint_naming,
                                     weights=names, extra_files=extra, **opts)
        self._pending = (fut, out)
        if not self.async_save:
            self.wait()

    def _save_sharded(self, out: Path, multi: bool) -> None:
        """Every rank: accelerate's FSDP contract (``save_fsdp_model``/``save_fsdp_optimizer`` on
        every rank, pre-hooks with an empty ``weights``), bytes through fastckpt's DTensor route:
        one HF-layout folder, each rank writing its chunks; the commit is rank 0's. Per-rank
        state (RNG, dataloader position) is gathered so every rank passes the same values."""
        acc = self.acc
        msds, osds = dt.state_dicts(acc)
        hook_files = st.run_save_hooks(acc, [], out.name)
        state: dict[str, Any] = {st.model_key(i): sd for i, sd in enumerate(msds)}
        names = {k: k for k in state}
        st.check_hook_files(hook_files, [*names, "state"])
        state["optimizers"] = osds
        state.update(self._objects())
        mine = {"rng": capture_rng_state(), "samplers": [st.dataloader_state(dl) for dl in acc._dataloaders]}
        every = dt.gather(mine) if multi else [mine]
        state["rng"], state["samplers"] = every[0]["rng"], every[0]["samplers"]  # as a DDP checkpoint
        state["rng_per_process"] = [e["rng"] for e in every]
        state["samplers_per_process"] = [e["samplers"] for e in every]
        self._start(state, out, names, {**self._config_file(), **hook_files})

    def _after_commit(self, step: int | None, user_hook: Callable[[Path], None] | None) -> Callable[[Path], None]:
        """``on_commit`` of a save (writer thread, after the commit): apply ``total_limit``, also
        when nobody waits for the save (one finished at interpreter exit); then the caller's own
        ``on_commit`` if ``save_options`` had one. A rotation failure is logged and raised by the
        next :meth:`wait` (the checkpoint itself is committed)."""
        def committed(path: Path) -> None:
            if step is not None:
                try:
                    self._rotate(protect=(step,))
                except Exception as e:
                    logger.error("fastckpt: total_limit rotation after %s failed: %s: %s", path,
                                 type(e).__name__, e)
                    self._rotate_error = e
            if user_hook is not None:
                user_hook(path)
        return committed

    def _distributed(self) -> bool:
        import torch.distributed as dist

        return self.acc.num_processes > 1 and dist.is_available() and dist.is_initialized()

    def wait(self) -> None:
        """Block until the pending save is committed (``total_limit`` applied).

        Raises:
            The background save's own exception (original type), or the rotation's.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            fut, out = pending
            fut.result()
            self.records.append({"path": str(out), "blocking_s": getattr(fut, "blocking_s", None),
                                 "total_s": getattr(fut, "total_s", None),
                                 "bytes": getattr(fut, "bytes_written", None)})
        err, self._rotate_error = self._rotate_error, None
        if err is not None:
            raise err

    def _rotate(self, protect: tuple[int, ...] = ()) -> None:
        """Apply ``total_limit``: keep the newest committed ``checkpoint_N`` folders plus
        ``protect`` (the one just saved, even when an earlier run left higher numbers),
        deleting the others through :func:`fastckpt.storage.prune_checkpoints` (which first
        removes dead writers' leftovers, e.g. a deletion interrupted by a crash)."""
        cfg = self.acc.project_configuration
        if not (cfg.automatic_checkpoint_naming and cfg.total_limit):
            return
        root = self._root()
        for step in prune_checkpoints(root, _AUTO_PREFIX, cfg.total_limit, protect=protect):
            logger.info("fastckpt: deleted %s (total_limit=%d)", root / f"{_AUTO_PREFIX}{step}", cfg.total_limit)

    # -- load ----------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """Newest committed ``checkpoint_N`` under ``project_dir/checkpoints``; newer folders that
        fastckpt did not commit (a save that crashed or is still writing) are logged and skipped.

        Raises:
            AccelerateCheckpointNotFoundError: a newer ``checkpoint_N`` holds accelerate's own files
                (``random_states_*.pkl``, ``*.bin``: written by ``save_state`` without the plugin).
                accelerate would resume from it; resuming silently from an older one is refused.
        """
        for n, p in reversed(step_folders(self._root(), _AUTO_PREFIX)):
            if fastckpt.is_committed(p):
                return p
            theirs = sorted(f.name for f in Path(p).iterdir() if f.suffix in (".pkl", ".bin")) if Path(p).is_dir() else []
            if theirs:
                raise AccelerateCheckpointNotFoundError(
                    f"{p} is the newest checkpoint and was written by accelerate's own save_state (it holds "
                    f"{', '.join(theirs[:3])}{' ...' if len(theirs) > 3 else ''}); fastckpt reads only what it "
                    f"saved. Load it with accelerate alone (before enabling the plugin), or pass input_dir= "
                    f"an older checkpoint_N to resume from that one")
            logger.info("fastckpt: skipping %s: no committed fastckpt manifest", p)
        return None

    def _wait_others(self, wanted: Callable[[Path], bool]) -> None:
        """Wait for other plugins' pending saves of folders this load may read (their errors
        stay theirs: ``exception()`` does not collect them)."""
        for other in list(_LIVE):
            pending = other._pending if other is not self else None
            if pending is not None and wanted(Path(pending[1])):
                pending[0].exception()

    def _source(self, input_dir) -> Path:
        acc = self.acc
        if input_dir is not None:
            folder = Path(os.path.abspath(os.path.expanduser(os.fspath(input_dir))))
            self._wait_others(lambda p: p == folder)
            if not folder.is_dir():
                raise AccelerateCheckpointNotFoundError(f"Tried to find {folder} but folder does not exist")
            if not fastckpt.is_committed(folder):
                raise AccelerateCheckpointNotFoundError(
                    f"{folder} holds no committed fastckpt checkpoint (no manifest.json): it was written by "
                    f"accelerate's own save_state, or a save into it was interrupted. Load it without "
                    f"fastckpt, or give a folder fastckpt committed")
            return folder
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise AccelerateStateError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = self._root()
        self._wait_others(lambda p: p.parent == root)
        folder = self.latest()
        if folder is None:
            raise AccelerateCheckpointNotFoundError(
                f"no committed fastckpt checkpoint_N under {root}; save_state() first or pass input_dir")
        return folder

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs) -> None:
        """Restore everything :meth:`save_state` wrote (bit-exact), in place.

        Args:
            input_dir: a committed checkpoint folder; ``None`` with automatic naming: the newest
                committed ``checkpoint_N`` (uncommitted ones are skipped).
            load_kwargs: :func:`fastckpt.load` options (``verify``, ``threads``, ``chunk_bytes``,
                ``io_backend``); torch.load's ``weights_only``/``mmap`` are accepted and moot.
            **load_model_func_kwargs: ``map_location`` (``None``, ``"cpu"``, ``"on_device"``:
                where tensors are read to, accelerate's rule for ``None``) and ``strict``
                (default True, like accelerate: keys must match).

        Raises:
            AccelerateCheckpointNotFoundError: (``FileNotFoundError`` and ``ValueError``) no such
                folder, or nothing committed there.
            AccelerateStateError: the checkpoint holds fewer models/optimizers/... than the
                accelerator, or automatic naming is off and no ``input_dir`` was given.
            StateDictMismatchError: stored weights do not match a model (before anything changes);
                FSDP2 models: ``StateMismatchError`` of :func:`fastckpt.load_into` (also before).
            TypeError: an unknown ``map_location``, ``load_kwargs`` key or keyword.
            fastckpt's read errors (``CorruptCheckpointError``, ``ChecksumMismatchError``, ...).
        """
        kwargs = dict(load_model_func_kwargs)
        device = st.resolve_map_location(self.acc, kwargs.pop("map_location", None))
        strict = bool(kwargs.pop("strict", True))
        if kwargs:
            raise TypeError(f"load_state() got unexpected keyword(s) {sorted(kwargs)}; the fastckpt plugin "
                            f"takes map_location, strict and load_kwargs")
        read_opts = st.load_options(load_kwargs)
        self.wait()
        acc = self.acc
        if self._distributed():  # the main process's pending save is committed for every rank
            acc.wait_for_everyone()
        folder = self._source(input_dir)
        if dt.sharded(acc):  # FSDP2: every rank fills its own shards
            self._load_sharded(folder, device, strict, read_opts)
            logger.info("fastckpt: loaded state from %s", folder)
            return
        snap = fastckpt.load(folder, device=device, **read_opts)
        models = list(acc._models)
        for hook in list(getattr(acc, "_load_model_state_pre_hook", {}).values()):
            hook(models, str(folder))  # as accelerate: may remove models it loads itself
        self._check(snap, models, folder, strict)
        self._apply(snap, models, folder)
        logger.info("fastckpt: loaded state from %s", folder)

    def _check(self, snap: dict, models: list, folder: Path, strict: bool) -> None:
        """Everything that can refuse the checkpoint, before anything is changed."""
        acc = self.acc
        for i, model in enumerate(models):
            if st.model_key(i) not in snap:
                raise AccelerateStateError(f"{folder} holds {sum(1 for k in snap if k.startswith('model'))} "
                                           f"model(s), the accelerator has {len(models)} to load")
            st.check_model(acc.unwrap_model(model), snap[st.model_key(i)], strict=strict,
                           what=st.model_key(i), folder=folder)
        for name, live in (("optimizers", acc._optimizers), ("schedulers", acc._schedulers),
                           ("custom", acc._custom_objects)):
            if len(snap[name]) != len(live):
                raise AccelerateStateError(f"{folder} holds {len(snap[name])} {name}, the accelerator has "
                                           f"{len(live)}: load a checkpoint saved with the same prepared and "
                                           f"registered objects")
        for i, (o, s) in enumerate(zip(acc._optimizers, snap["optimizers"])):
            live_sizes = [len(g["params"]) for g in o.param_groups]
            stored_sizes = [len(g["params"]) for g in s.get("param_groups", [])]
            if live_sizes != stored_sizes:  # torch's own check, made before anything is loaded
                raise AccelerateStateError(
                    f"{folder}: optimizer {i} was saved with parameter groups of {stored_sizes} parameters, "
                    f"this one has {live_sizes}: load a checkpoint saved from the same model and optimizer")

    def _load_sharded(self, folder: Path, device: str, strict: bool, read_opts: dict) -> None:
        """Every rank, accelerate's FSDP load contract (pre-hooks get no models; GradScaler before
        the optimizers): :func:`fastckpt.load_into` reads this rank's regions only (any saved world
        size), then ``set_state_dict``; per-rank state: :func:`.fsdp2.per_rank`."""
        acc = self.acc
        for hook in list(getattr(acc, "_load_model_state_pre_hook", {}).values()):
            hook([], str(folder))
        try:
            rest = fastckpt.load(folder, keys=list(dt.OBJECT_KEYS), device=device, **read_opts)
        except KeyError as e:
            raise AccelerateStateError(
                f"{folder} was not saved from FSDP2 (DTensor) models by this plugin ({e}); the accelerator's "
                f"models are FSDP2: load a checkpoint saved with FSDP2 models") from e
        msds, osds = dt.state_dicts(acc)
        target = {**rest, **{st.model_key(i): sd for i, sd in enumerate(msds)}, "optimizers": osds}
        got = dt.load_regions(target, folder, strict, read_opts)  # raises before writing
        if acc.scaler is not None and got.get("scaler") is not None:
            acc.scaler.load_state_dict(got["scaler"])
        dt.set_state_dicts(acc, [got[st.model_key(i)] for i in range(len(msds))], got["optimizers"], strict)
        self._apply_objects(got, folder, sharded=True)

    def _apply(self, snap: dict, models: list, folder: Path) -> None:
        acc = self.acc
        for i, model in enumerate(models):
            acc.unwrap_model(model).load_state_dict(snap[st.model_key(i)], strict=False)  # keys checked
        for o, s in zip(acc._optimizers, snap["optimizers"]):
            o.load_state_dict(s)
        if acc.scaler is not None and snap.get("scaler") is not None:
            acc.scaler.load_state_dict(snap["scaler"])
        self._apply_objects(snap, folder, sharded=False)

    def _apply_objects(self, snap: dict, folder: Path, *, sharded: bool) -> None:
        """Schedulers, registered objects, dataloaders, ``step``, iteration and RNG."""
        acc = self.acc
        for o, s in zip(acc._schedulers, snap["schedulers"]):
            o.load_state_dict(s)
        for o, s in zip(acc._custom_objects, snap["custom"]):
            o.load_state_dict(s)
        rank, world = acc.process_index, acc.num_processes
        samplers = (dt.per_rank(snap["samplers_per_process"], rank, world, "dataloader positions", folder)
                    if sharded else snap.get("samplers", []))
        for dl, s in zip(acc._dataloaders, samplers or []):
            st.restore_dataloader(dl, s)
        acc.step = int(snap["step"])
        cfg = acc.project_configuration
        it = st.loaded_iteration(snap, folder)
        if cfg.automatic_checkpoint_naming and it is not None and cfg.iteration <= it:
            cfg.iteration = it + 1  # the next save_state continues after the loaded checkpoint
        per_rank = snap.get("rng_per_process")
        if sharded:
            rng = dt.per_rank(per_rank, rank, world, "RNG states", folder)
            if rng is not None:
                restore_rng_state(rng)
        elif per_rank is not None and len(per_rank) == acc.num_processes:
            restore_rng_state(per_rank[acc.process_index])
        else:
            if per_rank is not None or acc.num_processes > 1:
                logger.warning("fastckpt: %s holds RNG states of %s processes, this run has %d: "
                               "every rank gets the main process's RNG state (resume not exact)",
                               folder, len(per_rank) if per_rank is not None else 1, acc.num_processes)
            restore_rng_state(snap["rng"])


def enable(accelerator, *, async_save: bool = False, **save_options) -> FastCkptState:
    """Make ``accelerator.save_state`` / ``load_state`` write and read through fastckpt.

    Args:
        accelerator: an ``accelerate.Accelerator`` (call after ``prepare`` or before; the lists
            of prepared objects and hooks are read at save time).
        async_save: stage and return; write in the background (default False).
        **save_options: ``max_shard_bytes``, ``threads``, ``staging_bytes``, ``o_direct``.

    Returns:
        The :class:`FastCkptState` now bound as ``accelerator.save_state``/``load_state`` (and
        ``accelerator.fastckpt``); its ``wait()`` blocks until the pending save committed.
        Enabling again first waits for the previous plugin's pending save.

    Raises:
        NotImplementedError: DeepSpeed or Megatron-LM accelerators (their engines own
            checkpointing; use fastckpt's DeepSpeed integration instead).
        AccelerateFSDP1Error: (a ``NotImplementedError``) FSDP1 (``fsdp_version=1`` or a
            ``FullyShardedDataParallel`` model); FSDP2 is supported.
    """
    kind = str(getattr(accelerator, "distributed_type", ""))
    if any(k in kind for k in ("DEEPSPEED", "MEGATRON")):
        raise NotImplementedError(f"fastckpt accelerate plugin does not handle {kind}")
    dt.check_not_fsdp1(accelerator)
    previous = getattr(accelerator, "fastckpt", None)
    if isinstance(previous, FastCkptState):
        previous.wait()
    plugin = FastCkptState(accelerator, async_save=async_save, **save_options)
    st.make_replayable(accelerator._dataloaders)
    if not getattr(accelerator.prepare, "_fastckpt_prepare", False):
        prepare = accelerator.prepare

        def prepare_replayable(*args, **kwargs):
            out = prepare(*args, **kwargs)
            st.make_replayable(accelerator._dataloaders)  # before the first epoch starts
            return out

        prepare_replayable._fastckpt_prepare = True
        accelerator.prepare = prepare_replayable
    accelerator.save_state = plugin.save_state
    accelerator.load_state = plugin.load_state
    accelerator.fastckpt = plugin
    return plugin
