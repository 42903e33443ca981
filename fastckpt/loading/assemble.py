"""Plain ``fastckpt.load`` of a multi-rank (format 1) checkpoint: Shard placeholders become full tensors.

In ``state.json`` a :class:`~fastckpt.Shard` value is ``{"__shard__": key path}`` and its pieces are
stored by their ranks (``rank*`` files, manifest keys ``@rank{r}/...``). :func:`piece_keys` says which
stored tensors to read; :func:`fill_placeholders` replaces each placeholder by the full tensor
assembled from its pieces, or raises :class:`~fastckpt.errors.ShardedCheckpointError` (pieces that
do not cover the tensor, rank-local subtrees): a caller never gets a placeholder dict back.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..errors import ShardedCheckpointError
from ..format.dtypes import str_to_dtype
from ..format.tree import join


def _shards(manifest: dict) -> dict:
    return (manifest.get("distributed") or {}).get("shards") or {}


def piece_keys(manifest: dict, keep: Callable[[str], bool] | None) -> list[str]:
    """Stored keys of the Shard pieces of every sharded key path that ``keep`` selects."""
    out = []
    for kp, info in _shards(manifest).items():
        if keep is None or keep(kp):
            out.extend(p["key"] for p in info["pieces"])
    return out


def fill_placeholders(tree: Any, manifest: dict, get: Callable[[str], torch.Tensor], root: str,
                      path: str = "") -> Any:
    """``tree`` with every ``{"__shard__": kp}`` replaced by the full tensor of ``kp``.

    Args:
        tree: the state rebuilt from ``state.json``.
        manifest: the checkpoint's manifest. get: stored key -> tensor read (the pieces).
        root: checkpoint folder (for messages).

    Raises:
        ShardedCheckpointError: the pieces do not cover the tensor (the checkpoint holds only some
            ranks' shards: fill a state in place with ``fastckpt.load_into``), or a rank-local subtree
            (saved with ``local_keys``: ``fastckpt.load_into(state, path, local_rank=r)``).
    """
    if isinstance(tree, dict):
        if len(tree) == 1 and "__shard__" in tree:
            return _assemble(tree["__shard__"], manifest, get, root)
        if len(tree) == 1 and "__rank_local__" in tree:
            raise ShardedCheckpointError(
                f"{root}: {path or tree['__rank_local__']!r} is a rank-local subtree (saved per rank with "
                f"local_keys by {manifest.get('world_size')} ranks); plain load cannot merge it: fill a state "
                "with one saved rank's with fastckpt.load_into(state, path, local_rank=r), or load the rest with "
                "load(path, keys=...)")
        return {k: fill_placeholders(x, manifest, get, root, join(path, k)) for k, x in tree.items()}
    if isinstance(tree, list):
        return [fill_placeholders(x, manifest, get, root, join(path, i)) for i, x in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(fill_placeholders(x, manifest, get, root, join(path, i)) for i, x in enumerate(tree))
    return tree


def _assemble(kp: str, manifest: dict, get: Callable[[str], torch.Tensor], root: str) -> torch.Tensor:
    info = _shards(manifest).get(kp)
    if info is None:
        raise ShardedCheckpointError(f"{root}: state.json names shard {kp!r}, which the manifest's "
                                     "distributed.shards lacks; the checkpoint is damaged (run `fastckpt verify`)")
    shape = list(info["global_shape"])
    have = sum(math.prod(p["shape"]) for p in info["pieces"])
    if have != math.prod(shape):
        raise ShardedCheckpointError(
            f"{root}: shard {kp!r} of global shape {shape} has pieces holding {have} of its {math.prod(shape)} "
            f"elements (saved ranks {sorted(p['rank'] for p in info['pieces'])}); plain load returns whole "
            "tensors only: fill an existing state in place with fastckpt.load_into(state, path)")
    first = get(info["pieces"][0]["key"]) if info["pieces"] else None
    out = torch.empty(shape, dtype=str_to_dtype(info["dtype"], tensor=kp, path=root),
                      device=first.device if first is not None else "cpu")
    for p in info["pieces"]:
        sl = tuple(slice(o, o + n) for o, n in zip(p["offsets"], p["shape"]))
        out[sl] = get(p["key"])
    return out
