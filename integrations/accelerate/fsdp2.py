"""The accelerate plugin's sharded route: models whose parameters are DTensors (FSDP2).

accelerate 1.15.0 saves an FSDP model with ``save_fsdp_model(fsdp_plugin, accelerator, model,
output_dir, i)`` and its optimizer with ``save_fsdp_optimizer(..., optimizer, accelerator._models[i],
output_dir, i)``, called by **every rank** (collective ``get_model_state_dict`` /
``get_optimizer_state_dict`` of ``torch.distributed.checkpoint.state_dict``); optimizer ``i`` belongs
to model ``i``; the save pre-hooks get an empty ``weights`` list (the models are saved by the FSDP
path); on load the GradScaler is restored before the optimizers (``set_optimizer_state_dict`` may
step it). The plugin keeps that contract and replaces the bytes' route:

- save: every rank takes ``get_state_dict(model_i, optimizer_i)`` (DTensor values, FQN keys) and
  every rank calls :func:`fastckpt.async_save` with the same state: one HF-layout folder of full
  tensors (docs/FORMAT.md "Version 2"; ``model.safetensors`` readable by ``from_pretrained``), each
  rank writing its own chunks. Non-tensor values must be equal on every rank (DCP's planner keeps
  one copy), so per-rank state (RNG, dataloader position) is gathered first and stored per rank.
- load: every rank fills its own shards with :func:`fastckpt.load_into` (reading only its regions,
  any world size) and hands them to ``set_state_dict``.

``FullyShardedDataParallel`` (FSDP1) models are refused
(:class:`~fastckpt.errors.AccelerateFSDP1Error`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fastckpt.errors import AccelerateFSDP1Error, AccelerateStateError

from ..hf.rank_state import torch_optimizer

logger = logging.getLogger(__name__)

#: Top-level keys of a sharded checkpoint besides ``model``, ``model_<i>`` and ``optimizers``.
OBJECT_KEYS = ("schedulers", "custom", "scaler", "step", "iteration", "rng", "samplers", "rng_per_process",
               "samplers_per_process")


def is_fsdp1(model) -> bool:
    """True for a model wrapped in (or holding) ``torch.distributed.fsdp.FullyShardedDataParallel``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def check_not_fsdp1(acc) -> None:
    """Refuse an accelerator using FSDP1.

    Raises:
        AccelerateFSDP1Error: ``distributed_type`` is FSDP with ``fsdp_version`` 1, or a prepared
            model holds a ``FullyShardedDataParallel`` module.
    """
    kind = str(getattr(acc, "distributed_type", ""))
    fsdp1 = "FSDP" in kind and not getattr(acc, "is_fsdp2", False)
    bad = [i for i, m in enumerate(getattr(acc, "_models", [])) if isinstance(m, torch.nn.Module) and is_fsdp1(m)]
    if fsdp1 or bad:
        where = f"prepared model(s) {bad} hold FullyShardedDataParallel modules" if bad else f"{kind} with fsdp_version=1"
        raise AccelerateFSDP1Error(
            f"fastckpt accelerate plugin: {where}: FSDP1 (FullyShardedDataParallel) is not supported. Use FSDP2 "
            f"(FullyShardedDataParallelPlugin(fsdp_version=2), or torch.distributed.fsdp.fully_shard): its "
            f"DTensor parameters are saved by every rank into one HF-layout checkpoint")


def sharded(acc) -> bool:
    """True when the accelerator's models go the sharded route (any prepared model holds DTensors).

    Raises:
        AccelerateFSDP1Error: see :func:`check_not_fsdp1`.
    """
    check_not_fsdp1(acc)
    import fastckpt

    return any(fastckpt.save_route([*m.parameters(), *m.buffers()]).dtensor
               for m in map(acc.unwrap_model, acc._models))


def _pairs(acc) -> list[tuple[Any, Any]]:
    """``(model_i, optimizer_i or None)`` in accelerate's pairing (optimizer ``i`` -> model ``i``).

    Raises:
        AccelerateStateError: more optimizers than models (accelerate's FSDP path pairs them by index).
    """
    models, opts = list(acc._models), list(acc._optimizers)
    if len(opts) > len(models):
        raise AccelerateStateError(
            f"{len(opts)} optimizers for {len(models)} FSDP2 model(s): accelerate's FSDP path saves optimizer i "
            f"with model i; prepare one optimizer per model")
    return [(m, torch_optimizer(opts[i]) if i < len(opts) else None) for i, m in enumerate(models)]


def state_dicts(acc) -> tuple[list[dict], list[dict]]:
    """``get_state_dict`` of every (model, optimizer) pair (collective: every rank, same order).

    Returns:
        ``(model state dicts, optimizer state dicts)``: DTensor values (local shards), FQN keys of
        the unwrapped model (what ``save_pretrained`` uses); one optimizer dict per optimizer
        (``{"state": {fqn: {...}}, "param_groups": [...]}``, a fresh optimizer's state initialised
        by torch as ``get_state_dict`` does).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    msds, osds = [], []
    for model, opt in _pairs(acc):
        model = acc.unwrap_model(model)
        if opt is None:
            msds.append(get_model_state_dict(model))
        else:
            msd, osd = get_state_dict(model, opt)
            msds.append(msd)
            osds.append(osd)
    return msds, osds


def load_regions(target: dict, folder, strict: bool, read_opts: dict) -> dict:
    """:func:`fastckpt.load_into` of ``target`` with ``torch.nn.Module.load_state_dict``'s rule for
    ``strict``: ``False`` skips missing and unexpected keys, but a tensor of another shape or dtype is
    still an error (accelerate's FSDP path, which loads through DCP, raises for it too).

    Raises:
        StateMismatchError: with ``strict``, any key/shape/dtype disagreement; without, shapes or
            dtypes only. Raised before any tensor of ``target`` is written.
    """
    import fastckpt
    from fastckpt.errors import StateMismatchError
    try:
        return fastckpt.load_into(target, folder, strict=True, **read_opts)
    except StateMismatchError as e:
        if strict or e.mismatched:
            raise
    return fastckpt.load_into(target, folder, strict=False, **read_opts)


def set_state_dicts(acc, msds: list[dict], osds: list[dict], strict: bool) -> None:
    """``set_state_dict`` of every (model, optimizer) pair with the filled dicts (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    opts = StateDictOptions(strict=strict)
    for i, (model, opt) in enumerate(_pairs(acc)):
        model = acc.unwrap_model(model)
        if opt is None:
            set_model_state_dict(model, msds[i], options=opts)
        else:
            set_state_dict(model, opt, model_state_dict=msds[i], optim_state_dict=osds[i], options=opts)


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (collective ``all_gather_object``; in-memory only, never
    read from a file)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def per_rank(saved: list | None, rank: int, world: int, what: str, folder) -> Any:
    """This rank's entry of a per-rank list saved by a run of ``len(saved)`` processes.

    Resuming at another world size restores what can be restored: rank ``r`` takes the saved rank
    ``r``'s entry when there is one. Rank 0 logs a warning naming the saved ranks whose entries no
    rank uses (fewer processes now) and the ranks that get none (more processes now).

    Returns:
        The entry, or ``None`` (nothing saved for this rank: the caller keeps the live state).
    """
    if saved is None:
        return None
    n = len(saved)
    if n != world and rank == 0:
        unused = list(range(world, n))
        new = list(range(n, world))
        parts = []
        if unused:
            parts.append(f"the {what} of saved rank(s) {unused} were not used")
        if new:
            parts.append(f"rank(s) {new} keep their own {what} (none saved for them)")
        logger.warning("fastckpt: %s was saved by %d process(es), this run has %d: each rank r < %d restored saved "
                       "rank r's %s; %s (resume not exact)", folder, n, world, min(n, world), what, "; ".join(parts))
    return saved[rank] if rank < n else None
