"""What a checkpoint holds, by key path, as stored pieces with checksums (no tensor data read).

:func:`open_index` turns any readable source into a :class:`CheckpointIndex`:

* fastckpt v1 (one process): one :class:`~fastckpt.loading.regions.Stored` per tensor, whole-tensor xxh3;
* fastckpt v1 multi-rank: replicated tensors as above; rank-local subtrees (``local_keys``) from
  the ``rank*`` files of the rank asked for;
* fastckpt v2: full tensors whose checksums are per chunk (``"chunks"``);
* a plain HF folder or safetensors file: tensors by name, no checksums.

Readers of regions (:mod:`fastckpt.loading.into`, :mod:`fastckpt.loading.dcp_reader`) use it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedValueError
from ..format.dtypes import itemsize, str_to_dtype
from ..format.layout import RANK_KEY
from ..format.manifest import RangeCheck
from ..storage.model_files import safe_join
from ..format.tree import join, unflatten
from ..storage.store import LOCAL
from .regions import Stored
from .resolve import Resolved, resolve


@dataclass
class TensorDesc:
    """One tensor of the checkpoint (global view).

    Attributes:
        key: key path (fastckpt) or tensor name (HF).
        shape: global shape. dtype: safetensors dtype string.
        pieces: stored tensors that tile it (one: every format stores full tensors).
        checks: checksummed element boxes of ``pieces[0]`` (the whole tensor or its format-2 chunks;
            :attr:`RangeCheck.elements <fastckpt.format.manifest.RangeCheck.elements>`); empty for HF files.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Stored]
    checks: list[RangeCheck] = field(default_factory=list)


@dataclass
class CheckpointIndex:
    """Tensors and non-tensor values of a checkpoint by key path.

    Attributes:
        resolved: the validated checkpoint (:func:`fastckpt.loading.resolve.resolve`).
        tensors: key path (or HF tensor name) -> :class:`TensorDesc`.
        values: key path -> non-tensor leaf value from ``state.json`` (fastckpt only).
        rank_local: key path -> top-level key of each rank-local subtree (``local_keys`` saves) that
            was not filled in from a saved rank (see ``local_rank`` of :func:`open_index`).
        views: key path -> ``(shape, safetensors dtype)`` of each tensor stored as a strided view of
            another tensor's storage (``w.t()`` beside ``w``): not a dense region of a file, so it is
            read whole (:func:`fastckpt.load`), then copied.
        tree: the saved state with each tensor as a :class:`Leaf` (fastckpt),
            or ``{name: Leaf}`` (HF files).
    """

    resolved: Resolved
    tensors: dict[str, TensorDesc] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_local: dict[str, Any] = field(default_factory=dict)
    views: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    tree: Any = None

    @property
    def is_fastckpt(self) -> bool:
        """True for a fastckpt checkpoint (manifest and skeleton), false for HF files."""
        return self.resolved.manifest is not None


class Leaf:
    """A stored tensor's place in :attr:`CheckpointIndex.tree` (``key``: its manifest key)."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


def _stored(r: Resolved, key: str, origin: tuple[int, ...] | None = None) -> Stored:
    """The :class:`Stored` of manifest key ``key`` (aliases followed, contiguous views resolved)."""
    assert r.manifest is not None
    key, e = r.manifest.resolve(key)
    if e.view is not None:
        assert e.shape is not None and e.stride is not None and e.dtype is not None and e.offset is not None
        base = _stored(r, e.view)
        shape = e.shape
        want, acc = [], 1
        for n in reversed(shape):
            want.insert(0, acc)
            acc *= n
        if math.prod(shape) > 1 and list(e.stride) != want:
            raise UnsupportedValueError(
                f"{r.root}: tensor {key!r} is stored as a strided view (stride {list(e.stride)}) of "
                f"{e.view!r}; read it with fastckpt.load(), load_into fills only dense regions")
        isz = itemsize(str_to_dtype(e.dtype, tensor=key, path=r.root))
        return Stored(key, base.file, base.abs_offset + e.offset, shape, e.dtype, isz,
                      origin or (0,) * len(shape))
    fname, info = r.tensors[key]
    isz = itemsize(str_to_dtype(info.dtype, tensor=key, path=r.file_path(fname)))
    return Stored(key, r.file_path(fname), r.headers[fname].data_offset + info.start, tuple(info.shape),
                  info.dtype, isz, origin or (0,) * len(info.shape))


def _checks(r: Resolved, key: str, st: Stored) -> list[RangeCheck]:
    assert r.manifest is not None
    key, e = r.manifest.resolve(key)
    where = f"tensor {key!r} in {os.path.basename(st.file)!r}"
    name = os.path.relpath(st.file, r.root)
    end = st.abs_offset + st.itemsize * math.prod(st.shape)
    if e.xxh3 is not None and e.view is None:
        return [RangeCheck(where, name, st.abs_offset, end, e.xxh3, key, None, st.shape, st.dtype)]
    return [RangeCheck(f"{where} chunk at offsets {list(c.offsets)} of shape {list(c.shape)}", name, st.abs_offset,
                       end, c.xxh3, key, c.box, st.shape, st.dtype) for c in e.chunks or ()]


def open_index(path: str | os.PathLike, local_rank: int | None = None) -> CheckpointIndex:
    """Validate ``path`` (every header, index and manifest entry) and index what it holds.

    Args:
        path: fastckpt checkpoint folder (format 1 or 2, one or many ranks), HF model folder (hub
            snapshot folders included) or one safetensors file.
        local_rank: saved rank whose rank-local subtrees (``local_keys`` saves) are indexed in place
            of their placeholders (``None``: left out, listed in :attr:`CheckpointIndex.rank_local`).

    Raises:
        CheckpointNotFoundError, HeaderError, CorruptCheckpointError, UnsafePathError: as
            :func:`fastckpt.loading.resolve.resolve`; CorruptCheckpointError also for malformed
            ``chunks`` or shard pieces that do not fit their tensor.
    """
    r = resolve(path)
    idx = CheckpointIndex(r)
    if r.manifest is None:
        checks: dict[str, list[RangeCheck]] = {}
        if r.owner is not None:  # one file of a checkpoint: its tensors' checksums from the manifest
            _, m, fname = r.owner
            by_key = {k: n for n, (k, _) in r.file_entries().items()}
            for c in m.checks(fname):
                if c.key in by_key:
                    checks.setdefault(by_key[c.key], []).append(c)
        for name, (fname, info) in r.tensors.items():
            isz = itemsize(str_to_dtype(info.dtype, tensor=name, path=r.file_path(fname)))
            st = Stored(name, r.file_path(fname), r.headers[fname].data_offset + info.start,
                        tuple(info.shape), info.dtype, isz, (0,) * len(info.shape))
            idx.tensors[name] = TensorDesc(name, st.shape, info.dtype, [st], checks.get(name, []))
        idx.tree = {name: Leaf(name) for name in r.tensors}
        return idx
    idx.tree = unflatten(r.skeleton, lambda k, kind: Leaf(k))
    _index_value(idx, idx.tree, "")
    if idx.rank_local and local_rank is not None:
        _add_rank_local(idx, local_rank)
    return idx


def _add_rank_local(idx: CheckpointIndex, rank: int) -> None:
    """Index saved rank ``rank``'s rank-local subtrees (``state-rank*.json``, keys ``@rank{r}/...``)."""
    r = idx.resolved
    assert r.manifest is not None
    dist = r.manifest.distributed
    name = dist.rank_local_skeletons.get(rank) if dist is not None else None
    if name is None:
        return  # that rank saved none: the state's keys under them stay missing
    spath = safe_join(r.root, name)
    try:
        skel = json.loads(LOCAL.read_bytes(spath))
    except (OSError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{spath}: rank {rank}'s rank-local skeleton is unreadable ({e}); run "
                                     "`fastckpt verify`", path=spath) from None
    pre = RANK_KEY.format(rank)
    local = unflatten(skel, lambda k, kind: Leaf(pre + k))
    local = local.get("local", {}) if isinstance(local, dict) else {}
    for path, key in list(idx.rank_local.items()):
        if key in local:
            _index_value(idx, local[key], path)
            del idx.rank_local[path]


def _index_value(idx: CheckpointIndex, v: Any, path: str) -> None:
    r = idx.resolved
    if isinstance(v, Leaf):
        try:
            st = _stored(r, v.key)
        except UnsupportedValueError:  # a strided view: read whole by whoever asks for it
            e = r.manifest.resolve(v.key)[1]
            idx.views[path] = (tuple(e.shape), e.dtype)
            return
        idx.tensors[path] = TensorDesc(path, st.shape, st.dtype, [st], _checks(r, v.key, st))
        return
    if isinstance(v, dict) and len(v) == 1 and "__rank_local__" in v:
        idx.rank_local[path] = v["__rank_local__"]
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _index_value(idx, x, join(path, k))
        if not v:
            idx.values[path] = {}
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _index_value(idx, x, join(path, i))
        if not v:
            idx.values[path] = type(v)()
    else:
        idx.values[path] = v


def covered(desc: TensorDesc) -> bool:
    """True when the pieces of ``desc`` hold every element of the tensor (they never overlap:
    each saving rank wrote its own piece)."""
    return sum(math.prod(p.shape) for p in desc.pieces) == math.prod(desc.shape)
