"""Per-rank state of the Trainer callback in multi-process training (DDP, FSDP2).

The Trainer writes one ``rng_state_{process_index}.pth`` per process (pickle) and restores each
process's own at resume (``Trainer._load_rng_state``, transformers 5.24.0). The callback mirrors that
without pickle: under ``torch.distributed`` with more than one rank, *every* rank takes part in each
save (:func:`fastckpt.async_save` with ``process_group=``), the replicated state (model, optimizer,
scheduler, trainer state) is written once, its write units split among the ranks, and the RNG
states (``rng``, ``epoch_rng``: Python, NumPy, torch CPU and, when initialised, CUDA) are
rank-local subtrees (``local_keys``: ``rank{r:05d}-*.safetensors`` + ``state-rank{r:05d}.json``,
docs/FORMAT.md "Multi-rank"). A failure on one rank fails the save on every rank
(:class:`~fastckpt.errors.DistributedSaveError`) and nothing is committed.

States holding DTensors (FSDP2 ``fully_shard``) take the DCP route of :func:`fastckpt.async_save`,
which refuses ``local_keys``: there the RNG states are saved for rank 0 only (a WARNING at the first
save says so) and the other ranks keep their own at resume.

At resume each rank restores the RNG state saved by the rank of its own index
(:func:`load_rank_rng`); a rank the checkpoint has no RNG state for keeps its own and warns, and
rank 0 names the saved ranks whose RNG states no process used (resume at a smaller world size).
"""

from __future__ import annotations

import logging
from typing import Any

import fastckpt

from .hf_snapshot import capture_rng_state

logger = logging.getLogger("fastckpt.integrations.hf_trainer")

#: The callback's rank-local top-level keys (one RNG state per rank).
RNG_KEYS = ("rng", "epoch_rng")

#: :func:`fastckpt.async_save` options the DCP route (DTensor states) refuses.
_DTENSOR_REFUSED = ("link_from", "defer", "defer_frozen", "staging_bytes", "local_keys")


def trainer_group(args=None) -> Any:
    """The process group every rank saves through, or ``None`` (one process saves alone).

    ``torch.distributed`` initialised with more than one rank (and, when ``args`` is given,
    ``args.world_size > 1``: the Trainer runs distributed): the default group
    (``torch.distributed.group.WORLD``); otherwise ``None``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if args is not None and getattr(args, "world_size", 1) < 2:
        return None
    return dist.group.WORLD


def group_rank(group) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (``(0, 1)`` for ``None``)."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def has_dtensor(state: Any) -> bool:
    """True when a tensor leaf of the nested ``state`` (dict/list/tuple) is a ``DTensor``."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(has_dtensor(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_dtensor(v) for v in state)
    return False


def rank_save_options(group, snap: dict, opts: dict) -> dict:
    """The save options of one callback save, adjusted for ``group`` (see the module docstring).

    Args:
        group: :func:`trainer_group` (``None``: returned unchanged).
        snap: the snapshot to save (top-level ``rng``/``epoch_rng`` keys when RNG states are saved).
        opts: the options the callback would use in one process (not modified).

    Returns:
        A new dict: ``process_group`` and ``local_keys`` added; for a state holding DTensors,
        ``process_group`` left to the DTensors' meshes, the options the DCP route refuses removed
        and rank 1.. 's RNG states dropped from ``snap`` (in place).
    """
    out = dict(opts)
    if group is None:
        return out
    if has_dtensor(snap):
        for name in _DTENSOR_REFUSED:
            out.pop(name, None)
        return out
    out["process_group"] = group
    out["local_keys"] = tuple(k for k in RNG_KEYS if k in snap)
    return out


def _saved_world(ckpt: str) -> tuple[int, bool]:
    """``(world_size, rank_local_rng)`` of checkpoint ``ckpt``'s manifest."""
    m = fastckpt.read_manifest(ckpt) or {}
    dist = m.get("distributed") or {}
    keys = (dist.get("rank_local") or {}).get("keys") or ()
    return int(m.get("world_size") or 1), "rng" in keys


def load_replicated(ckpt: str) -> dict:
    """Everything of callback checkpoint ``ckpt`` but its rank-local RNG states (a plain dict)."""
    _, local = _saved_world(ckpt)
    if not local:
        return fastckpt.load(ckpt, keys=None)
    skel = fastckpt.open_checkpoint(ckpt).skeleton
    return fastckpt.load(ckpt, keys=[k for k in skel if k not in RNG_KEYS])


def load_rank_rng(ckpt: str, snap: dict, rank: int, world_size: int) -> tuple[dict | None, dict | None]:
    """The ``(rng, epoch_rng)`` states this rank restores from ``ckpt`` (each ``None`` when absent).

    Args:
        ckpt: committed callback checkpoint folder.
        snap: what :func:`load_replicated` returned for it (holds ``rng`` in a one-rank checkpoint).
        rank, world_size: this process's rank and the world size of the resumed run.

    A one-rank checkpoint's RNG state goes to rank 0; a multi-rank one's rank ``r`` state to rank
    ``r``. A rank without a saved state gets ``(None, None)`` and a WARNING; rank 0 warns, naming
    them, when saved ranks ``>= world_size`` are not used.
    """
    saved, local = _saved_world(ckpt)
    if not local:
        if rank == 0 and saved > 1 and world_size < saved:
            logger.warning("fastckpt: %s holds the RNG state of rank 0 only (a DTensor/FSDP2 save of %d ranks): "
                           "ranks 1..%d of that run are not restored", ckpt, saved, saved - 1)
        if rank == 0:
            return snap.get("rng"), snap.get("epoch_rng")
        logger.warning("fastckpt: %s has no RNG state for rank %d (saved by %d rank(s)%s): rank %d keeps its own "
                       "RNG state; the resumed run is not bit-exact with an uninterrupted one", ckpt, rank, saved,
                       ", RNG of rank 0 only" if saved > 1 else "", rank)
        return None, None
    if rank == 0 and saved > world_size:
        logger.warning("fastckpt: %s was saved by %d ranks, resumed on %d: the RNG states of rank(s) %s were not "
                       "used (each rank restores the state of its own index)", ckpt, saved, world_size,
                       list(range(world_size, saved)))
    if rank >= saved:
        logger.warning("fastckpt: %s holds RNG states of ranks 0..%d only (saved by %d ranks): rank %d keeps its "
                       "own RNG state; the resumed run is not bit-exact with an uninterrupted one",
                       ckpt, saved - 1, saved, rank)
        return None, None
    tmpl = {"rng": capture_rng_state(), "epoch_rng": capture_rng_state()}
    man = fastckpt.read_manifest(ckpt)
    if not any(k.startswith(f"@rank{rank}/") and "/epoch_rng/" in k for k in man.get("tensors", {})):
        tmpl.pop("epoch_rng")  # None at that save (no epoch began yet)
    got = fastckpt.load_into(tmpl, ckpt, strict=False, local_rank=rank)
    return got["rng"], got.get("epoch_rng")
