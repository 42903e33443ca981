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

States holding DTensors (FSDP2 ``fully_shard``) take the DCP route of :func:`fastckpt.async_save`.
That route accepts ``local_keys`` now (issue 20), but the callback keeps the layout its FSDP2
checkpoints already have, so that they stay resumable: each RNG state is packed
into a fixed-layout ``uint8`` row (:func:`pack_rng`) and the rows of all ranks form one DTensor
``Shard(0)`` over the ranks of the model's device mesh (``rng_by_rank``/``epoch_rng_by_rank``, shape
``[world_size, n]``, row ``r`` saved by rank ``r``, stored as a full safetensors tensor; a 2-D mesh such
as HSDP's gets a flat 1-D mesh over the same ranks for these rows).

At resume each rank restores the RNG state saved by the rank of its own index
(:func:`load_rank_rng`); a rank the checkpoint has no RNG state for keeps its own and warns, and
rank 0 names the saved ranks whose RNG states no process used (resume at a smaller world size).
"""

from __future__ import annotations

import logging
from typing import Any

import fastckpt

from .snapshot import capture_rng_state

logger = logging.getLogger("fastckpt.integrations.hf.trainer")

#: The callback's rank-local top-level keys (one RNG state per rank).
RNG_KEYS = ("rng", "epoch_rng")



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
    route = fastckpt.save_route(snap)
    if route.dtensor:  # the options that route refuses dropped; the RNG states go into packed rows, not local_keys
        out = route.drop(out)
        out.pop("local_keys", None)
        mesh = _mesh_of(snap)
        for key in RNG_KEYS:
            rng = snap.pop(key, None)
            if rng is not None:
                from torch.distributed.tensor import DTensor, Shard

                snap[f"{key}_by_rank"] = DTensor.from_local(pack_rng(rng)[None], mesh, [Shard(0)])
        return out
    out["process_group"] = group
    out["local_keys"] = tuple(k for k in RNG_KEYS if k in snap)
    return out


def _mesh_of(state: Any) -> Any:
    """A 1-D device mesh over the ranks of the first DTensor's mesh, in rank order (that mesh
    itself when 1-D; for a 2-D one, e.g. HSDP, a flat mesh over the same ranks, made once per set
    of ranks: every rank of the mesh calls this at the same save, as it saves together)."""
    from torch.distributed.tensor import DTensor

    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
            if mesh.ndim == 1 and mesh.mesh.tolist() == ranks:
                return mesh
            key = (mesh.device_type, tuple(ranks))
            if key not in _FLAT_MESHES:
                from torch.distributed.device_mesh import DeviceMesh
                _FLAT_MESHES[key] = DeviceMesh(mesh.device_type, ranks)
            return _FLAT_MESHES[key]
        stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ())
    raise ValueError("no DTensor in the state")


#: (device type, ranks) -> the flat 1-D mesh the RNG rows of a multi-dimensional mesh's ranks live on.
_FLAT_MESHES: dict[tuple, Any] = {}


_U32, _I64, _F64 = "<u4", "<i8", "<f8"


def pack_rng(rng: dict) -> Any:
    """One rank's RNG state (:func:`~fastckpt.integrations.hf.snapshot.capture_rng_state`) as a
    ``uint8`` CPU tensor of fixed layout (little-endian): Python ``random`` (version, 625 words,
    gauss flag and value), NumPy MT19937 (624 keys, pos, has_gauss, cached gaussian), the torch CPU
    state, then the CUDA states (count, then each one's length and bytes). Equal hardware gives
    equal lengths on every rank. :func:`unpack_rng` inverts it."""
    import numpy as np
    import torch

    ver, words, gauss = rng["python"]
    name, keys, pos, has_gauss, cached = rng["numpy"]
    parts = [np.array([ver], _I64).tobytes(), np.asarray(words, _U32).tobytes(),
             np.array([gauss is not None], _I64).tobytes(), np.array([gauss or 0.0], _F64).tobytes(),
             np.asarray(keys, _U32).tobytes(), np.array([pos, has_gauss], _I64).tobytes(),
             np.array([cached], _F64).tobytes()]
    tensors = [rng["cpu"]] + list(rng.get("cuda", ()))
    parts.append(np.array([len(tensors) - 1], _I64).tobytes())
    for t in tensors:
        b = t.cpu().contiguous().numpy().tobytes()
        parts += [np.array([len(b)], _I64).tobytes(), b]
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def unpack_rng(row: Any) -> dict:
    """The RNG state dict packed by :func:`pack_rng` (``row``: its ``uint8`` tensor)."""
    import numpy as np
    import torch

    b = row.cpu().numpy().tobytes()
    at = 0

    def take(dtype: str, n: int):
        nonlocal at
        a = np.frombuffer(b, dtype, n, at)
        at += a.nbytes
        return a

    ver = int(take(_I64, 1)[0])
    words = tuple(int(w) for w in take(_U32, 625))
    has_gauss = bool(take(_I64, 1)[0])
    gauss = float(take(_F64, 1)[0])
    keys = take(_U32, 624).copy()
    pos, np_has = (int(x) for x in take(_I64, 2))
    cached = float(take(_F64, 1)[0])
    n_cuda = int(take(_I64, 1)[0])
    states = []
    for _ in range(n_cuda + 1):
        n = int(take(_I64, 1)[0])
        states.append(torch.from_numpy(take("u1", n).copy()))
    rng = {"python": (ver, words, gauss if has_gauss else None), "numpy": ("MT19937", keys, pos, np_has, cached),
           "cpu": states[0]}
    if n_cuda:
        rng["cuda"] = states[1:]
    return rng


def _saved_world(ckpt: str) -> tuple[int, bool]:
    """``(world_size, rank_local_rng)`` of checkpoint ``ckpt``'s manifest."""
    m = fastckpt.read_manifest(ckpt)
    keys = m.distributed.rank_local_keys if m.distributed is not None else ()
    return m.world_size, "rng" in keys


def load_replicated(ckpt: str, skip: tuple[str, ...] = ()) -> dict:
    """Everything of callback checkpoint ``ckpt`` but its rank-local RNG states and the top-level
    keys in ``skip`` (a plain dict of full tensors)."""
    _, local = _saved_world(ckpt)
    if not local and not skip:
        return fastckpt.load(ckpt, keys=None)
    skel = fastckpt.open_checkpoint(ckpt).skeleton
    drop = set(skip) | (set(RNG_KEYS) if local else set())
    return fastckpt.load(ckpt, keys=[k for k in skel if k not in drop])


def load_rank_rng(ckpt: str, snap: dict, rank: int, world_size: int) -> tuple[dict | None, dict | None]:
    """The ``(rng, epoch_rng)`` states this rank restores from ``ckpt`` (each ``None`` when absent).

    Args:
        ckpt: committed callback checkpoint folder.
        snap: what :func:`load_replicated` returned for it (holds ``rng`` in a one-rank checkpoint,
            ``rng_by_rank`` in an FSDP2 one).
        rank, world_size: this process's rank and the world size of the resumed run.

    A one-rank checkpoint's RNG state goes to rank 0; a multi-rank one's rank ``r`` state to rank
    ``r``. A rank without a saved state gets ``(None, None)`` and a WARNING; rank 0 warns, naming
    them, when saved ranks ``>= world_size`` are not used.
    """
    if "rng_by_rank" in snap:  # FSDP2: one packed row per rank
        saved, local = int(snap["rng_by_rank"].shape[0]), True
    else:
        saved, local = _saved_world(ckpt)
        saved = saved if local else 1
    if rank == 0 and saved > world_size:
        logger.warning("fastckpt: %s was saved by %d ranks, resumed on %d: the RNG states of rank(s) %s were not "
                       "used (each rank restores the state of its own index)", ckpt, saved, world_size,
                       list(range(world_size, saved)))
    if rank >= saved:
        logger.warning("fastckpt: %s has no RNG state for rank %d (RNG states of %d rank(s) saved): rank %d keeps "
                       "its own RNG state; the resumed run is not bit-exact with an uninterrupted one",
                       ckpt, rank, saved, rank)
        return None, None
    if "rng_by_rank" in snap:
        ep = snap.get("epoch_rng_by_rank")
        return unpack_rng(snap["rng_by_rank"][rank]), unpack_rng(ep[rank]) if ep is not None else None
    if not local:
        return snap.get("rng"), snap.get("epoch_rng")
    tmpl = {"rng": capture_rng_state(), "epoch_rng": capture_rng_state()}
    man = fastckpt.read_manifest(ckpt)
    if not any(k.startswith(f"@rank{rank}/") and "/epoch_rng/" in k for k in man.tensors):
        tmpl.pop("epoch_rng")  # None at that save (no epoch began yet)
    got = fastckpt.load_into(tmpl, ckpt, strict=False, local_rank=rank)
    return got["rng"], got.get("epoch_rng")


# --- FSDP2 (parameters are DTensors): the calls accelerate's FSDP2 checkpointing makes ---------
def is_sharded(model) -> bool:
    """True when a parameter of ``model`` is a ``DTensor`` (FSDP2 ``fully_shard``, tensor parallel)."""
    return model is not None and fastckpt.save_route(list(model.parameters())).dtensor


def torch_optimizer(optimizer) -> Any:
    """The ``torch.optim.Optimizer`` inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer``).

    The wrapper is itself a ``torch.optim.Optimizer`` subclass whose ``step()`` does nothing while
    gradients accumulate (``sync_gradients`` False): torch's ``get_state_dict`` initialises a fresh
    optimizer's state by calling ``step()``, so it must get the inner one."""
    import torch

    while optimizer is not None:
        inner = getattr(optimizer, "optimizer", None)
        if inner is optimizer or not (isinstance(inner, torch.optim.Optimizer)
                                      or (inner is not None and not isinstance(optimizer, torch.optim.Optimizer))):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def optimizer_state(model, optimizer) -> Any:
    """The optimizer state the callback saves: ``optimizer.state_dict()``; for a model with DTensor
    parameters the state of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
    (parameter FQN keys, DTensor values: what accelerate's FSDP2 ``save_fsdp_optimizer`` saves),
    which :func:`fastckpt.async_save` writes through its DTensor route. ``None`` without optimizer."""
    opt = torch_optimizer(optimizer)
    if opt is None:
        return None
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt)


def restore_sharded(ckpt: str, model, optimizer, model_state: dict) -> None:
    """Fill a live FSDP2 model and its optimizer in place from callback checkpoint ``ckpt``.

    Each rank reads only its own shards (:func:`fastckpt.load_into`; any saved world size). The
    model: ``model_state`` (the callback's snapshot of it, DTensor parameters under HF names) is
    filled in place. The optimizer: ``get_optimizer_state_dict`` (which creates the state of an
    optimizer that has not stepped yet) is filled, then ``set_optimizer_state_dict`` applies it
    (the calls of accelerate's FSDP2 ``load_fsdp_optimizer``). Every rank must call this together
    (``get/set_optimizer_state_dict`` are collectives).

    Raises:
        StateMismatchError: the checkpoint's keys/shapes/dtypes are not those of the live model or
            optimizer (nothing written).
    """
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    opt = torch_optimizer(optimizer)
    state = {"model": model_state}
    if opt is not None:
        state["optimizer"] = get_optimizer_state_dict(model, opt)
    stored = fastckpt.read_manifest(ckpt).tensors
    leaves = _tensor_paths(state)
    missing = [k for k in leaves if k not in stored]
    shapes = {k: tuple(t.shape if stored[k].shape is None else stored[k].shape) for k, t in leaves.items()
              if k in stored}
    bad = [(k, tuple(t.shape), shapes[k]) for k, t in leaves.items() if k in shapes and shapes[k] != tuple(t.shape)]
    if bad:
        from fastckpt.errors import StateMismatchError

        raise StateMismatchError(path=str(ckpt), mismatched=[(k, a, b, ckpt) for k, a, b in bad], message=(
            f"{ckpt}: {len(bad)} tensor(s) of the live FSDP2 model/optimizer have other global shapes than the "
            f"checkpoint's, e.g. {bad[:3]} (key, live, saved): resume from a checkpoint of the same model"))
    if missing:  # strict=False below skips the checkpoint's other keys (trainer, scheduler, RNG), not these
        from fastckpt.errors import StateMismatchError

        raise StateMismatchError(path=str(ckpt), missing=missing, message=(
            f"{ckpt}: the live FSDP2 model/optimizer has {len(missing)} tensor(s) the checkpoint lacks, "
            f"e.g. {missing[:3]}: resume from a checkpoint of the same model and optimizer"))
    with torch.no_grad():
        state = fastckpt.load_into(state, ckpt, strict=False)
    if opt is not None:
        set_optimizer_state_dict(model, opt, state["optimizer"])


def _tensor_paths(state: Any, prefix: str = "") -> dict[str, Any]:
    """Key path (``a/b/0``) -> tensor leaf of a nested dict/list state."""
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_tensor_paths(v, f"{prefix}/{k}" if prefix else str(k)))
    return out
