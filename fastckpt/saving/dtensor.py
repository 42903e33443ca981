"""DTensor values in a state: find them, refuse what cannot be saved, stand in for them, pick the group.

A DTensor (FSDP2, tensor parallel) is stored like a plain tensor holding its ``full_tensor()``;
to plan those files every rank needs only each DTensor's global shape and dtype. For
:func:`fastckpt.saving.collect.collect` (which plans files, names and the JSON skeleton) a
DTensor is replaced by a *stand-in*: a plain CPU tensor of the global shape and dtype that
allocates one element (a zero-stride view), one per DTensor object (a DTensor stored under two
key paths stays one stored tensor plus an alias, as a shared plain tensor would).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from typing import Any

import torch

from ..coordination import LOCAL, Coordinator
from ..errors import UnsupportedValueError
from ..format.tree import join


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` when that module is already imported, else ``None``.

    A state cannot hold a DTensor unless ``torch.distributed.tensor`` is in ``sys.modules``
    (a DTensor is made by that module): never import it to find out (0.55 s on a save's
    blocking path, the first save of a process).
    """
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def walk_state(v: Any, path: str, fn) -> None:
    """Call ``fn(key path, value)`` on ``v`` and every value nested in its dicts, lists and tuples
    (pre-order; key paths as :func:`fastckpt.format.tree.join` builds them)."""
    fn(path, v)
    if isinstance(v, dict):
        for k, x in v.items():
            walk_state(x, join(path, k) if isinstance(k, (str, int)) else path, fn)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            walk_state(x, join(path, i), fn)


def has_dtensor(state: Any) -> bool:
    """True when ``state`` holds a DTensor anywhere (dicts, lists, tuples)."""
    dt = dtensor_type()
    if dt is None:
        return False
    found = []
    walk_state(state, "", lambda p, v: found.append(p) if isinstance(v, dt) else None)
    return bool(found)


def check_state(state: Any) -> list:
    """Refuse what a DTensor save cannot store, naming the key path and the type; returns the
    DTensors' device meshes (distinct, in state order).

    Supported: DTensors whose placements are ``Shard(d)`` / ``Replicate()`` on any mesh (uneven
    shards included) with a plain local tensor, next to plain tensors and JSON values.

    Raises:
        UnsupportedValueError: a DTensor with a ``Partial()`` (pending reduction) or other
            placement, a DTensor whose local tensor is itself a tensor subclass, or a plain value
            that is a tensor subclass (``torch.nn.Parameter`` excepted). Raised before any file exists.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    meshes: list = []

    def check(path: str, v: Any) -> None:
        where = path or "<root>"
        if isinstance(v, DTensor):
            for p in v.placements:
                if type(p) not in (Shard, Replicate):
                    raise UnsupportedValueError(
                        f"DTensor at key path {where!r} has placement {p!r} ({type(p).__name__}); fastckpt saves "
                        "Shard(d) and Replicate() placements: call .redistribute(mesh, [Replicate()] or "
                        "[Shard(d)]) (or .full_tensor()) first. Nothing was written")
            local = v.to_local()
            if type(local) not in (torch.Tensor, torch.nn.Parameter):
                raise UnsupportedValueError(
                    f"DTensor at key path {where!r} has a local tensor of type {type(local).__module__}."
                    f"{type(local).__qualname__} (a tensor subclass); fastckpt stores plain tensors: convert the "
                    "local tensor (e.g. dequantize) first. Nothing was written")
            if not any(m is v.device_mesh for m in meshes):
                meshes.append(v.device_mesh)
        elif isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedValueError(
                f"value at key path {where!r} is a tensor subclass {type(v).__module__}.{type(v).__qualname__}; "
                "fastckpt stores plain tensors and DTensors: convert it first. Nothing was written")
    walk_state(state, "", check)
    return meshes


def stand_in(t: Any) -> torch.Tensor:
    """A plain CPU tensor with ``t``'s global shape and dtype that allocates one element."""
    return torch.empty((1,) if t.dim() else (), dtype=t.dtype).expand(t.shape)


def view_key(t: torch.Tensor) -> tuple:
    """Identity of the view ``t`` (storage, offset, shape, strides, dtype, device): equal for two
    tensor objects that are the same view of one storage (e.g. tied weights in a ``state_dict``)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype) if t.numel() else (id(t),)


def with_stand_ins(state: Any) -> tuple[Any, dict[str, Any]]:
    """``state`` with every tensor and DTensor replaced by :func:`stand_in` (containers rebuilt, other
    values shared), and ``{key path: tensor or DTensor}`` of every key path that held one.

    Objects that are the same view (:func:`view_key`; a DTensor: the same object) share one
    stand-in, so they are stored once plus an ``alias`` entry, as in a one-process save;
    different views of one storage are stored as separate tensors (not ``view`` entries)."""
    dt = dtensor_type()
    found: dict[str, Any] = {}
    memo: dict[Any, torch.Tensor] = {}

    def rep(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            found[path] = v
            key = id(v) if dt is not None and isinstance(v, dt) else view_key(v)
            if key not in memo:
                memo[key] = stand_in(v)
            return memo[key]
        if isinstance(v, dict):
            return {k: rep(x, join(path, k) if isinstance(k, (str, int)) else path) for k, x in v.items()}
        if isinstance(v, list):
            return [rep(x, join(path, i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return tuple(rep(x, join(path, i)) for i, x in enumerate(v))
        return v
    return rep(state, ""), found


def placement_of(v: Any) -> dict:
    """``{"mesh_shape", "placements"}`` of DTensor ``v`` as the manifest records them (``"Shard(1)"``,
    ``"Replicate()"``; informational, docs/FORMAT.md "Version 2")."""
    return {"mesh_shape": list(v.device_mesh.shape),
            "placements": [f"Shard({p.dim})" if hasattr(p, "dim") else f"{type(p).__name__}()" for p in v.placements]}


def refuse_local_dtensors(local: Any) -> None:
    """Refuse DTensors inside the ``local_keys`` subtrees of a save (``local``: the split's rank-local part).

    Raises:
        UnsupportedValueError: naming the key paths (a DTensor is one global tensor: save it outside ``local_keys``).
    """
    dts = [p for p, v in with_stand_ins(local)[1].items() if hasattr(v, "placements")]
    if dts:
        raise UnsupportedValueError(
            f"local_keys subtree holds DTensors at key paths {dts[:5]}; a DTensor is one global tensor saved by every "
            "rank together: keep it out of local_keys (put only per-rank plain values there). Nothing was written")


def mesh_coordinator(process_group: Any, ranks: list[int]) -> Coordinator:
    """The coordinator of a save of DTensors: ``process_group``'s when given, else the one of the global
    ``ranks`` of the DTensors' device meshes (through the default store; no process group is created)."""
    if process_group is not None and not (isinstance(process_group, str) and process_group == LOCAL):
        return Coordinator.for_group(process_group)
    world = Coordinator.for_group(None)
    if world.is_single or len(ranks) == world.world_size:
        return world
    return replace(world, rank=ranks.index(world.global_rank), world_size=len(ranks),
                   group_key="g" + "-".join(map(str, ranks)))


def mesh_ranks(meshes: list) -> list[int]:
    """Global ranks of every device mesh in ``meshes`` (sorted, distinct)."""
    return sorted({int(r) for m in meshes for r in m.mesh.flatten().tolist()})


def leads_dtensor_save(state: Any) -> bool:
    """True on the rank that is rank 0 of the save of DTensor ``state`` (the lowest global rank of
    its device meshes: rank 0 of :func:`background_group` of those ranks), which commits it.

    Raises:
        UnsupportedValueError: a value DTensor saves refuse (see :func:`check_state`).
    """
    import torch.distributed as dist
    return dist.get_rank() == mesh_ranks(check_state(state))[0]


_GROUPS: dict[tuple[int, ...], Any] = {}
_GROUPS_LOCK = threading.Lock()


def background_group(ranks: list[int] | None = None) -> Any:
    """The dedicated gloo process group fastckpt runs DCP's collectives on for ``ranks``
    (default: every rank), created once per set of ranks with ``dist.new_group(backend="gloo")``
    and again after ``destroy_process_group()`` (a group of the previous world is never reused).

    A background save whose collectives shared the training group would interleave with the
    training step's own all-gathers / reduce-scatters in a different order on each rank (a hang,
    then a timeout); on its own group they cannot. Every rank of ``ranks`` must call this the first
    time for a set of ranks (it creates the group), in the same order as other group creations.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("fastckpt: DTensor saves need torch.distributed initialized (init_process_group)")
    key = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()))
    with _GROUPS_LOCK:
        g = _GROUPS.get(key)
        if g is not None:
            try:
                dist.get_process_group_ranks(g)
            except KeyError:  # destroyed with its world: torch's group registry no longer has it
                g = None
        if g is None:
            g = _GROUPS[key] = dist.new_group(list(key), backend="gloo", use_local_synchronization=True)
        return g
