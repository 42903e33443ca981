"""Who writes what in a save: the state split by rank and the units each rank owns (pure, no I/O).

A save of one process is the one-rank case: every unit is its own. In a multi-rank save the
state holds replicated values (equal on every rank; their write units are cut into contiguous
runs of about equal bytes, one per rank, so each rank writes part of every shared file),
and rank-local subtrees (top-level keys in ``local_keys``: each rank writes them to its own
``rank0000r-*.safetensors`` files). All ranks build the same global plan from the
replicated specs and every rank's local specs; see docs/FORMAT.md ("Multi-rank").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


from ..format.layout import RANK_KEY, ArraySpec, SavePlan, plan_save


@dataclass
class Split:
    """A rank's state split for a multi-rank save.

    Attributes:
        replicated: the state with local subtrees replaced by ``{"__rank_local__": key}``.
        local: ``{"local": {key: subtree}}`` of this rank.
    """

    replicated: Any
    local: dict


def split_state(state: Any, local_keys: tuple[str, ...]) -> Split:
    """Separate replicated values and rank-local top-level subtrees (``local_keys``)."""
    local: dict = {}
    if not isinstance(state, dict):
        return Split(state, local)
    rep = {}
    for k, v in state.items():
        if k in local_keys:
            local.setdefault("local", {})[k] = v
            rep[k] = {"__rank_local__": k}
        else:
            rep[k] = v
    return Split(rep, local)


def has_split(state: Any, local_keys: tuple[str, ...]) -> bool:
    """True when ``state`` holds a ``local_keys`` subtree."""
    return isinstance(state, dict) and any(k in state for k in local_keys)


def local_stem(rank: int) -> str:
    """File stem of rank ``rank``'s local files: ``rank0000r``."""
    return f"rank{rank:05d}"


def rank_specs(specs: list[ArraySpec], rank: int) -> list[ArraySpec]:
    """``specs`` of rank ``rank``'s local state as placed in the global plan: keys under
    :data:`RANK_KEY`, files ``rank0000r-*``, tensor names unchanged."""
    pre = RANK_KEY.format(rank)
    return [replace(s, key=pre + s.key, group=local_stem(rank)) for s in specs]


def spec_list(specs: list[ArraySpec]) -> list[list]:
    """JSON form of ``specs`` (for the store)."""
    return [[s.key, s.name, s.group, s.dtype, list(s.shape), s.nbytes] for s in specs]


def specs_from_list(rows: list[list]) -> list[ArraySpec]:
    """Inverse of :func:`spec_list`."""
    return [ArraySpec(k, n, g, d, tuple(shape), nb) for k, n, g, d, shape, nb in rows]


def global_plan(replicated: list[ArraySpec], local_by_rank: list[list[ArraySpec]], *, max_shard_bytes: int,
                chunk_bytes: int, metadata: dict[str, str] | None) -> SavePlan:
    """The plan every rank builds alike: replicated files, then each rank's local files.

    Replicated files are laid out as in a one-process save of the replicated state cut for
    ``len(local_by_rank)`` writers (:func:`plan_save` ``writers``: up to a file per rank, none under
    16 MiB; file layouts of one stem do not depend on other stems).
    """
    specs = list(replicated) + [s for specs in local_by_rank for s in specs]
    return plan_save(specs, max_shard_bytes=max_shard_bytes, chunk_bytes=chunk_bytes, metadata=metadata,
                     writers=len(local_by_rank))


def partition_units(plan: SavePlan, n: int, units: list[int] | None = None) -> list[tuple[int, int]]:
    """Cut ``units`` (indexes into ``plan.units``, default all, in stream order) into ``n``
    contiguous runs ``[a, b)`` of positions in that list, of about equal bytes (pure)."""
    idx = list(range(len(plan.units))) if units is None else units
    total = sum(plan.units[i].nbytes for i in idx)
    bounds, done, i = [0], 0, 0
    for r in range(1, n):
        goal = total * r // n
        while i < len(idx) and done + plan.units[idx[i]].nbytes // 2 < goal:
            done += plan.units[idx[i]].nbytes
            i += 1
        bounds.append(i)
    bounds.append(len(idx))
    return [(bounds[r], bounds[r + 1]) for r in range(n)]


@dataclass(frozen=True)
class Ownership:
    """Which units and files of a plan each rank of a writing group writes (pure).

    Attributes:
        group: ranks writing into one folder (all ranks, or one node's ranks in marker mode).
        units: rank -> unit indexes it writes (stream order).
        files: file indexes that exist in this group's folder.
    """

    group: tuple[int, ...]
    units: dict[int, tuple[int, ...]]
    files: tuple[int, ...]

    @staticmethod
    def of(plan: SavePlan, group: list[int], world_size: int) -> "Ownership":
        """Replicated units split in runs over ``group``; local units to their rank."""
        local_file = {local_stem(r): r for r in range(world_size)}

        def owner_of_file(name: str) -> int | None:
            return local_file.get(name.split("-", 1)[0])

        file_owner = [owner_of_file(f.name) for f in plan.files]
        rep = [i for i, u in enumerate(plan.units) if file_owner[u.file_index] is None]
        runs = partition_units(plan, len(group), rep)
        units = {r: tuple(rep[a:b]) for r, (a, b) in zip(group, runs)}
        for i, u in enumerate(plan.units):
            o = file_owner[u.file_index]
            if o is not None and o in units:
                units[o] += (i,)
        files = tuple(i for i, o in enumerate(file_owner) if o is None or o in group)
        return Ownership(tuple(group), {r: tuple(sorted(v)) for r, v in units.items()}, files)
