"""Load a multi-rank checkpoint on any world size, each rank reading only what it needs.

* Replicated values: every rank reads them whole (any world size).
* :class:`~fastckpt.saving.ranks.Shard` values: rank ``r`` of ``W`` gets the ``torch.chunk``
  piece along the dimension the pieces were split on (``W == 1``: the whole tensor); only the
  saved pieces that overlap it are read. So 2 -> 1 reassembles and 1 -> 2 splits.
* Rank-local subtrees (``local_keys``): rank ``r`` gets what saved rank ``r`` wrote (or
  ``local_rank_from``); they carry no placement, so they do not reshard.
"""

from __future__ import annotations

import threading
import warnings
import json
import os
import re
from typing import Any

import torch

from ..storage.commit import is_committed
from ..coordination import DEFAULT_TIMEOUT_S, Coordinator
from ..format.layout import RANK_KEY
from ..format.dtypes import str_to_dtype
from ..errors import CheckpointNotFoundError
from .reader import load as load_single, open_checkpoint, read_tensors
from ..format.tree import key_filter, unflatten


def target_region(global_shape: list[int], dim: int, rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """``(offsets, shape)`` of the ``torch.chunk(world_size)[rank]`` piece along ``dim`` (pure)."""
    n = global_shape[dim] if global_shape else 0
    size = -(-n // world_size) if n else 0
    a = min(rank * size, n)
    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    if global_shape:
        offsets[dim], shape[dim] = a, min(size, n - a)
    return offsets, shape


def _split_dim(pieces: list[dict]) -> int:
    for d in range(len(pieces[0]["offsets"])):
        if len({p["offsets"][d] for p in pieces}) > 1:
            return d
    return 0


def _resolve_entry(entries: dict, raw: dict, key: str) -> torch.Tensor:
    e = entries[key]
    if "alias" in e:
        return raw[e["alias"]]
    if "view" in e:
        blob = raw[e["view"]]
        dt = str_to_dtype(e["dtype"], tensor=key)
        isz = torch.empty((), dtype=dt).element_size()
        return torch.empty(0, dtype=dt).set_(blob.untyped_storage(), (blob.storage_offset() + e["offset"]) // isz,
                                             e["shape"], e["stride"])
    return raw[key]


def _stored(entries: dict, key: str) -> str:
    e = entries[key]
    return e.get("alias") or e.get("view") or key


def load(path: str | os.PathLike, *, process_group: Any = None, rank: int | None = None,
         world_size: int | None = None, local_rank_from: int | None = None, keys: Any = None,
         device: str | torch.device = "cpu", threads: int | None = None, verify: bool = False) -> Any:
    """Load the part of a (multi- or single-rank) checkpoint that this rank needs.

    .. deprecated:: 0.2
        Use :func:`fastckpt.load_into` (fills an existing plain or DTensor state in place, any world
        size to any, reading only each rank's bytes). This function keeps working for one release
        and emits a ``DeprecationWarning``; ``local_rank_from`` is ``load_into``'s ``local_rank``.

    Args:
        path: committed checkpoint folder.
        process_group: group whose rank/size select the pieces (``None``: world, or 0 of 1).
        rank, world_size: override the group's (e.g. to reassemble everything in one process).
        local_rank_from: saved rank whose rank-local subtrees to return (default ``rank``).
        keys: key paths / prefixes to load (``None``: everything).
        device: where tensors end up (default ``"cpu"``).
        threads: reads in flight. verify: check xxh3 of each tensor read.

    Returns:
        The state with :class:`~fastckpt.saving.ranks.Shard` values replaced by this rank's piece
        (a plain tensor) and rank-local subtrees filled in.

    Raises:
        CheckpointNotFoundError: not committed, or no rank-local state for this rank.
        CorruptCheckpointError, HeaderError, ChecksumMismatchError: as :func:`fastckpt.load`.
    """
    warnings.warn("fastckpt.loading.sharded.load is deprecated and will be removed in the next release; "
                  "use fastckpt.load_into(state, path), which fills an existing (DTensor or plain) state in "
                  "place on any world size", DeprecationWarning, stacklevel=2)
    coord = Coordinator.for_group(process_group)
    rank = coord.rank if rank is None else rank
    world_size = coord.world_size if world_size is None else world_size
    r = open_checkpoint(path)
    m = r.manifest.to_dict() if r.manifest else {}  # deprecated reader: reads the JSON form
    dist = m.get("distributed")
    if dist is None:
        return load_single(path, keys=keys, device=device, threads=threads, verify=verify)
    entries = m["tensors"]
    keep = key_filter(keys)
    need: set[str] = set()
    markers: dict[str, Any] = {}

    def note(key: str, kind: str) -> None:
        need.add(_stored(entries, key))

    def find(v: Any) -> None:
        if isinstance(v, dict):
            if "__dict__" in v and len(v["__dict__"]) == 1 and v["__dict__"][0][0] in ("__shard__", "__rank_local__"):
                markers[json.dumps(v["__dict__"][0])] = v["__dict__"][0]
            for x in (v["__dict__"] if "__dict__" in v else v.values()):
                find(x)
        elif isinstance(v, list):
            for x in v:
                find(x)

    unflatten(r.skeleton, note, keep)
    find(r.skeleton)
    src = rank if local_rank_from is None else local_rank_from
    local_skel, pre = None, RANK_KEY.format(src)
    if any(m[0] == "__rank_local__" for m in markers.values()):
        name = dist["rank_local"]["skeletons"].get(str(src))
        if name is None:
            raise CheckpointNotFoundError(f"{path}: rank-local state was saved by {m['world_size']} ranks; "
                                          f"saved rank {src} has none (pass local_rank_from=)")
        with open(os.path.join(r.root, name), "rb") as f:
            local_skel = json.loads(f.read())
        unflatten(local_skel, lambda k, kind: need.add(_stored(entries, pre + k)), None)
    plans = {}
    for kind, kp in markers.values():
        if kind == "__shard__" and (keep is None or keep(kp)):
            info = dist["shards"][kp]
            dim = _split_dim(info["pieces"])
            off, shape = target_region(info["global_shape"], dim, rank, world_size)
            hits = [p for p in info["pieces"] if _overlap(p, off, shape)]
            plans[kp] = (info, off, shape, hits)
            need.update(_stored(entries, p["key"]) for p in hits)
    raw = read_tensors(r, sorted(need), threads=threads, verify=verify)
    shards = {kp: _assemble(raw, entries, *p) for kp, p in plans.items()}
    local = None
    if local_skel is not None:
        local = unflatten(local_skel, lambda k, kind: _resolve_entry(entries, raw, pre + k), None).get("local", {})
    out = unflatten(r.skeleton, lambda k, kind: _resolve_entry(entries, raw, k), keep)
    return _to(_fill(out, shards, local), device)


def _overlap(p: dict, off: list[int], shape: list[int]) -> bool:
    return all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(p["offsets"], p["shape"], off, shape)) \
        or not shape


def _assemble(raw: dict, entries: dict, info: dict, off: list[int], shape: list[int], hits: list[dict]) -> torch.Tensor:
    out = torch.empty(shape, dtype=str_to_dtype(info["dtype"]))
    for p in hits:
        t = _resolve_entry(entries, raw, p["key"])
        src, dst = [], []
        for a, n, b, m in zip(p["offsets"], p["shape"], off, shape):
            lo, hi = max(a, b), min(a + n, b + m)
            src.append(slice(lo - a, hi - a))
            dst.append(slice(lo - b, hi - b))
        out[tuple(dst)] = t[tuple(src)]
    return out


def _fill(v: Any, shards: dict, local: dict | None) -> Any:
    if isinstance(v, dict):
        if len(v) == 1 and "__shard__" in v:
            return shards[v["__shard__"]]
        if len(v) == 1 and "__rank_local__" in v:
            return local[v["__rank_local__"]]
        return {k: _fill(x, shards, local) for k, x in v.items()}
    if isinstance(v, list):
        return [_fill(x, shards, local) for x in v]
    if isinstance(v, tuple):
        return tuple(_fill(x, shards, local) for x in v)
    return v


def _to(v: Any, device: str | torch.device) -> Any:
    if torch.device(device).type == "cpu":
        return v
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device) for x in v)
    return v


#: group -> newest_common_step calls of this process on it: names the call's store keys alike on every
#: rank of the group, whatever other groups did meanwhile (a process-wide counter would not)
_COMMON_CALLS: dict[str, int] = {}
_COMMON_LOCK = threading.Lock()


def committed_steps(root: str | os.PathLike, prefix: str = "step-") -> list[int]:
    """Steps ``{root}/{prefix}{n}`` that hold a valid ``manifest.json`` (commit marker), ascending."""
    pat = re.compile(re.escape(prefix) + r"(\d+)$")
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names
                  if (m := pat.match(n)) and is_committed(os.path.join(root, n)))


def newest_common_step(root: str | os.PathLike, *, prefix: str = "step-", process_group: Any = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> int | None:
    """Newest step committed on every node of ``commit="marker"`` saves (restart point after a crash).

    Every rank of the group calls it with its own node-local ``root``; the committed steps of all
    ranks are exchanged through the group's store and the newest step present everywhere is
    returned (``None``: none). A crash between node markers leaves a step some nodes committed
    and others did not; it is skipped. In one process: the newest committed step under ``root``.
    """
    coord = Coordinator.for_group(process_group)
    mine = committed_steps(root, prefix)
    with _COMMON_LOCK:
        n = _COMMON_CALLS[coord.group_key] = _COMMON_CALLS.get(coord.group_key, 0) + 1
    sess = coord.session(f"common/{n}", timeout_s)
    try:
        every = sess.all_gather("steps", mine, "listing committed steps")
    finally:
        sess.close()
    common = set(every[0]).intersection(*map(set, every[1:]))
    return max(common) if common else None
