"""load_into: fill an existing state in place, each rank reading only the bytes of its own shards.

Every tensor leaf of the state (plain ``torch.Tensor``, ``nn.Parameter``, NumPy array, or a
``DTensor``: its ``to_local()`` is filled with the global region
``compute_local_shape_and_global_offset`` gives) is matched by key path to a tensor of the
checkpoint (:mod:`fastckpt.loading.stored`); the region's bytes are computed from the stored
pieces (:mod:`fastckpt.loading.regions`) and read straight into the destination when it is a
contiguous CPU tensor, else through a bounded host buffer (``buffer_bytes``) and copied. No
collective is needed: every rank plans from its own DTensors. Non-tensor leaves come back in the
returned tree with the checkpoint's values (``optimizer.load_state_dict`` can follow).

Reads are exact or refuse, as ``torch.distributed.checkpoint.load`` with its ``FileSystemReader``
(which reads the stored tensor and ``target.copy_(stored)``s it): a stored tensor whose dtype differs
from the destination's is read in its stored dtype and cast with ``copy_`` (values equal
``stored.to(dest.dtype)``; bytes are never reinterpreted), a shape difference is refused.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ChecksumMismatchError, CorruptCheckpointError, InvalidArgumentError, StateMismatchError
from ..format.dtypes import DTYPE_TO_STR, str_to_dtype
from ..format.manifest import RangeCheck
from ..format.stateful import is_stateful, load_back, to_state_dicts
from ..format.tree import join
from ..storage.io import PosixBackend, get_backend, readv_exact
from ..storage.locate import is_url, store_for
from .chunks import box_bytes, chunk_problem
from .reader import READ_CHUNK_BYTES, check_byte_options, check_flags, check_threads, default_read_threads, read_subtrees
from .regions import Box, ByteRun, Stored, box_runs, contains, dim0_blocks, intersect, split_runs
from .stored import CheckpointIndex, TensorDesc, open_index

#: Host bounce memory (bytes) for destinations that are not contiguous CPU tensors.
BUFFER_BYTES = 64 << 20

logger = logging.getLogger(__name__)


@dataclass
class LoadIntoReport:
    """What :func:`load_into` did besides filling the matching tensors (pass one as ``report=``).

    Attributes:
        missing_keys: key paths of the state the checkpoint lacks, left untouched (``strict=False``;
            in the other modes they raise), as ``nn.Module.load_state_dict``'s ``missing_keys``.
        unexpected_keys: key paths (HF folders: tensor names) of the checkpoint the state does not
            name: not read (with ``strict=True`` they raise), as ``load_state_dict``'s ``unexpected_keys``.
        cast: ``(key path, stored dtype, state dtype)`` of each tensor read in its stored dtype and
            cast into the state's (dtype strings as safetensors writes them, e.g. ``"F32"``, ``"BF16"``).
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    cast: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class FillTarget:
    """One tensor leaf to fill: ``local`` holds global region ``region`` of ``desc``'s tensor."""

    key: str
    local: torch.Tensor
    region: Box
    desc: TensorDesc
    parts: list[tuple[Stored, Box]] = field(default_factory=list)
    stored: torch.dtype | None = None  # the stored dtype when it differs from ``local``'s (cast on copy)


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, Box, tuple[int, ...]]:
    """``(local tensor, global region (offsets, shape), global shape)`` of a tensor leaf.

    A ``DTensor``'s local tensor is its ``to_local()`` (same storage); its region follows its mesh
    and placements (``Shard``, uneven shards and ``Replicate`` included). A plain tensor is the
    whole tensor at offsets 0.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        DTensor = ()  # type: ignore[assignment]
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        with torch.no_grad():
            local = t.to_local().detach()
        shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if len(off) != len(t.shape):  # this rank is not part of the mesh: nothing to fill
            return local, ((0,) * t.dim(), (0,) * t.dim()), tuple(t.shape)
        return local, (tuple(off), tuple(shape)), tuple(t.shape)
    t = t.detach()
    return t, ((0,) * t.dim(), tuple(t.shape)), tuple(t.shape)


def _hf_names(idx: CheckpointIndex, state: Any) -> dict[tuple, str]:
    """The stored HF tensor each leaf of ``state`` (by its key segments) is filled from: the longest
    suffix of the key's dotted parts that names one. The parts are the key segments split at ``.``: a
    nested ``{"model": sd}`` and a flat module-prefixed key (``SentenceTransformer(...).state_dict()``'s
    ``0.auto_model.embeddings...``) both drop their prefix. A stored tensor fills one key only: the
    one that drops the fewest parts; keys that tie, or lose to a nearer name, are missing (as torch's
    ``load_state_dict`` finds them), never filled with another key's tensor (``1.0.weight`` from a file
    whose ``0.weight`` belongs to the state's own ``0.weight``)."""
    claims: dict[str, list[tuple[int, tuple]]] = {}
    for _, _, segs in _leaves(state):
        parts = [p for s in segs for p in str(s).split(".")]
        for i in range(len(parts)):
            name = ".".join(parts[i:])
            if name in idx.tensors:
                claims.setdefault(name, []).append((i, segs))
                break
    out = {}
    for name, cl in claims.items():
        nearest = min(i for i, _ in cl)
        winners = [segs for i, segs in cl if i == nearest]
        if len(winners) == 1:
            out[winners[0]] = name
    return out


def _refuse_meta(local: torch.Tensor, path: str) -> None:
    """Raise :class:`InvalidArgumentError` (a ``ValueError``) for a state tensor on the meta device."""
    if local.device.type == "meta":
        raise InvalidArgumentError(f"{path!r}: the state tensor is on the meta device (no memory to fill); "
                                   "allocate it (e.g. model.to_empty(device=...)) before load_into")


def _leaves(state: Any, path: str = "", segs: tuple = ()):
    """Every leaf of ``state`` as ``(value, key path, key segments)``, depth first in insertion order;
    an empty dict/list/tuple is a leaf (a fresh optimizer's ``state: {}``), a list position is a
    :class:`_ListIndex` segment."""
    if isinstance(state, dict) and state:
        for k, x in state.items():
            yield from _leaves(x, join(path, k), segs + (k,))
    elif isinstance(state, (list, tuple)) and state:
        for i, x in enumerate(state):
            yield from _leaves(x, join(path, i), segs + (_ListIndex(i),))
    else:
        yield state, path, segs


class _Plan:
    """What to read and what disagrees, built before any byte is read or written."""

    def __init__(self, idx: CheckpointIndex):
        self.idx = idx
        self._keys: list[str] | None = None  # every stored key path, sorted (built on first use)
        self.hf_names: dict[tuple, str] = {}  # leaf key segments -> stored HF tensor (a non-fastckpt folder)
        self.targets: list[FillTarget] = []
        self.values: dict[str, Any] = {}
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.missing_tensors: dict[str, torch.Tensor] = {}  # path -> the state's tensor (for ties)
        self.mismatched: list[tuple] = []
        self.cast: list[tuple[str, str, str]] = []
        self.subtrees: dict[str, str] = {}  # state path of an empty container -> stored key path it takes
        self.views: dict[str, tuple[torch.Tensor, str]] = {}  # path -> (state tensor, stored strided view's key)
        self.sharded_subtrees: set[str] = set()  # empty containers over DTensor-saved subtrees (missing)

    def leaf(self, v: Any, path: str, segs: tuple) -> None:
        idx = self.idx
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)  # shares memory: filling it fills the array
        name = self._dcp_name(path, segs) if idx.is_fastckpt else self.hf_names.get(segs)
        if name in idx.views and isinstance(v, torch.Tensor):
            self._view(v, path, name)
            return
        if isinstance(v, torch.Tensor):
            desc = idx.tensors.get(name) if name is not None else None
            if desc is None:
                if name in idx.values:
                    self.mismatched.append((path, _describe(v), f"a {type(idx.values[name]).__name__} value", ""))
                else:
                    self.missing.append(path)
                    self.missing_tensors[path] = v
                return
            self.used.add(name)
            self._tensor(v, path, desc)
            return
        if name is not None and name in idx.values:
            self.used.add(name)
            self.values[path] = idx.values[name]
        elif isinstance(v, (dict, list, tuple)) and not v and self._take_subtree(path, name):
            pass
        elif name is not None and name in idx.tensors:
            self.used.add(name)
            self.mismatched.append((path, f"a {type(v).__name__} value", _describe_desc(idx.tensors[name]),
                                    os.path.basename(idx.tensors[name].pieces[0].file)))
        else:
            self.missing.append(path)

    def _take_subtree(self, path: str, name: str | None) -> bool:
        """An empty container of the state (a fresh optimizer's ``state: {}``) where the checkpoint
        holds a subtree: take the subtree whole, as ``torch.load`` + ``load_state_dict`` would (it is
        read after the fills, into new CPU tensors). Not when a tensor of it was saved from a DTensor:
        its full tensors on every rank are not what a sharded optimizer's ``load_state_dict`` takes
        (``get_state_dict`` builds a state with the tensors to fill); it stays missing."""
        idx = self.idx
        if not idx.is_fastckpt or name is None:
            return False
        if self._keys is None:  # sorted once per plan: each empty container is one bisect, not a scan
            self._keys = sorted({*idx.tensors, *idx.values, *idx.views})
        under = []
        for k in self._keys[bisect.bisect_left(self._keys, name + "/"):]:
            if not k.startswith(name + "/"):
                break
            under.append(k)
        entries = idx.resolved.manifest.tensors
        if not under:
            return False
        if any(entries[k].placement is not None for k in under if k in entries):
            self.sharded_subtrees.add(path)
            return False
        self.used.update(under)
        self.subtrees[path] = name
        return True

    def _dcp_name(self, path: str, segs: tuple) -> str:
        """The stored key path for the state's ``path``: itself, or else the path with its int keys as
        str keys (or digit str keys as ints) when only that is stored. DCP names a value by its fqn
        (``optim.state.0.step``), the same for ``0`` and ``"0"``, and its default planner hands the
        writer str keys: a folder ``dcp.save`` wrote through ``FastCkptWriter`` holds the optimizer's
        ``state/"0"`` where ``opt.state_dict()`` has ``state/0``; DCP's own load fills either."""
        idx = self.idx
        if path in idx.tensors or path in idx.values or not segs:
            return path
        for flip in (lambda s: str(s) if isinstance(s, int) and not isinstance(s, _ListIndex) else s,
                     lambda s: int(s) if isinstance(s, str) and s.isdigit() and str(int(s)) == s else s):
            alt = ""
            for seg in segs:
                alt = join(alt, flip(seg))
            if alt != path and (alt in idx.tensors or alt in idx.values):
                return alt
        return path

    def tied(self) -> list[str]:
        """Drop from :attr:`missing` (and return) the state's tensors that share their memory exactly
        (storage, offset, shape, strides, dtype) with a tensor being filled: a tied weight the file
        stores once (``save_pretrained``'s tied ``lm_head.weight``, ``safetensors.torch.save_model``'s
        dropped duplicates) is filled through its tie, as ``from_pretrained`` and
        ``safetensors.torch.load_model`` (strict) accept it."""
        filled = {_memory(t.local) for t in self.targets if t.local.device.type != "meta"}
        tied = [p for p in self.missing if p in self.missing_tensors and self.missing_tensors[p].numel()
                and self.missing_tensors[p].device.type != "meta" and _memory(self.missing_tensors[p]) in filled]
        self.missing = [p for p in self.missing if p not in tied]
        return tied

    def fill_ties_once(self) -> list[tuple[list[str], bool | None]]:
        """Keep one target per memory the state ties (tensors sharing storage, offset, shape, strides
        and dtype: ``lm_head.weight`` and ``embed_tokens.weight`` of a tied model) when the checkpoint
        holds each of them: the last in state order is filled, as ``load_state_dict`` copies each key in
        turn and the last write stays. Filling them all would write one memory from several threads
        at once and check it against every key's checksum (a false mismatch when the stored values differ).

        Returns:
            ``(keys of the group, in state order; whether their stored values differ: True / False from
            the manifest's checksums, None when the file has none)`` per tied group.
        """
        groups: dict[tuple, list[FillTarget]] = {}
        for t in self.targets:
            if t.local.numel():
                groups.setdefault(_memory(t.local), []).append(t)
        out, drop = [], set()
        for g in groups.values():
            if len(g) < 2:
                continue
            drop.update(id(t) for t in g[:-1])
            sums = [tuple(c.xxh3 for c in t.desc.checks) for t in g]
            differ = None if not all(sums) else len(set(sums)) > 1 or len({t.desc.dtype for t in g}) > 1
            out.append(([t.key for t in g], differ))
        if drop:
            self.targets = [t for t in self.targets if id(t) not in drop]
        return out

    def rank_local_hint(self, path: str) -> str:
        """Why ``path`` may be missing: it lies under a rank-local subtree the asked rank lacks."""
        for kp in self.idx.rank_local:
            if path == kp or path.startswith(kp + "/"):
                return (f" (under rank-local subtree {kp!r}, saved per rank with local_keys; the saved rank "
                        "asked for (local_rank=) saved none)")
        return ""

    def _tensor(self, v: torch.Tensor, path: str, desc: TensorDesc) -> None:
        local, region, gshape = local_region(v)
        fname = os.path.basename(desc.pieces[0].file) if desc.pieces else ""
        if gshape != desc.shape:
            self.mismatched.append((path, _describe(v), _describe_desc(desc), fname))
            return
        where = desc.pieces[0].file if desc.pieces else self.idx.resolved.root
        stored: torch.dtype | None = str_to_dtype(desc.dtype, tensor=path, path=where)
        if stored == v.dtype:
            stored = None
        else:  # cast as DCP's reader does (target.copy_(stored))
            self.cast.append((path, desc.dtype, DTYPE_TO_STR.get(v.dtype, str(v.dtype))))
        if tuple(local.shape) != region[1]:
            raise InvalidArgumentError(f"{path!r}: local tensor of shape {list(local.shape)} does not match its "
                                       f"DTensor region {list(region[1])}")
        _refuse_meta(local, path)
        t = FillTarget(path, local, region, desc, stored=stored)
        got = 0
        for st in desc.pieces:
            b = intersect(st.box, region)
            if b is not None:
                t.parts.append((st, b))
                got += math.prod(b[1])
        if got != math.prod(region[1]):
            raise CorruptCheckpointError(
                f"{self.idx.resolved.root}: the stored pieces of {path!r} cover {got} of the {math.prod(region[1])} "
                f"elements of region offsets {list(region[0])} shape {list(region[1])} (global shape "
                f"{list(desc.shape)}): the checkpoint's shards are incomplete", path=self.idx.resolved.root, tensor=path)
        self.targets.append(t)

    def _view(self, v: torch.Tensor, path: str, name: str) -> None:
        """A tensor the checkpoint stores as a strided view of another's storage (``w.t()`` beside
        ``w``): checked now, read whole after the fills and copied (cast as ``copy_`` casts)."""
        shape, dtype = self.idx.views[name]
        local, region, gshape = local_region(v)
        if gshape != shape:
            self.mismatched.append((path, _describe(v), f"shape {list(shape)} dtype {dtype}", ""))
            return
        _refuse_meta(local, path)
        self.used.add(name)
        if dtype != DTYPE_TO_STR.get(v.dtype):
            self.cast.append((path, dtype, DTYPE_TO_STR.get(v.dtype, str(v.dtype))))
        self.views[path] = (v, name)

    def unexpected(self) -> list[str]:
        idx = self.idx
        return sorted(k for k in list(idx.tensors) + list(idx.values) + list(idx.views) if k not in self.used)


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} dtype {DTYPE_TO_STR.get(t.dtype, str(t.dtype))}"


def _describe_desc(d: TensorDesc) -> str:
    return f"shape {list(d.shape)} dtype {d.dtype}"


def _memory(t: torch.Tensor) -> tuple:
    """What identifies the memory a tensor (a DTensor: its local shard) views: two tensors with the
    same are one parameter tied under two names."""
    t = local_region(t)[0] if hasattr(t, "to_local") else t
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _ListIndex(int):
    """A list/tuple position in a key path's segments (a dict's int key is a plain int): DCP's str
    fqn keys stand for dict keys only, so :meth:`_Plan._dcp_name` never flips a position."""


def _rebuild(state: Any, path: str, values: dict[str, Any]) -> Any:
    if isinstance(state, dict) and state:
        d = {k: _rebuild(x, join(path, k), values) for k, x in state.items()}
        return type(state)(d) if isinstance(state, OrderedDict) else d  # model.state_dict() stays an OrderedDict
    if isinstance(state, (list, tuple)) and state:
        out = [_rebuild(x, join(path, i), values) for i, x in enumerate(state)]
        if isinstance(state, list):
            return out
        return tuple(out) if type(state) is tuple else type(state)(*out)  # namedtuple
    return values[path] if path in values else state


def _prefix_hint(missing: list[str], stored: list[str]) -> str:
    """A line naming a name prefix that the checkpoint's keys carry and the state's lack (or the
    reverse), when every missing key differs from a stored one by it alone (DDP's ``module.``,
    ``torch.compile``'s ``_orig_mod.``); "" otherwise."""
    if not missing or not stored:
        return ""
    def split(k: str) -> tuple[str, str]:
        head, _, last = k.rpartition("/")
        return head, last
    by_tail: dict[tuple[str, str], str] = {}
    for k in stored:
        head, last = split(k)
        parts = last.split(".")
        for i in range(1, len(parts)):
            by_tail.setdefault((head, ".".join(parts[i:])), ".".join(parts[:i]) + ".")
    extra = {by_tail.get(split(m)) for m in missing}
    if len(extra) == 1 and None not in extra:
        p = extra.pop()
        return (f"every missing key is a checkpoint key without the prefix {p!r} (e.g. {missing[0]!r}): the "
                f"checkpoint was saved from a wrapped model (DDP 'module.', torch.compile '_orig_mod.'); save the "
                f"unwrapped model's state_dict(), or rename the keys (strip {p!r}) before load_into")
    have = {split(k) for k in stored}
    fewer = set()
    for m in missing:
        head, last = split(m)
        parts = last.split(".")
        fewer.add(next((".".join(parts[:i]) + "." for i in range(1, len(parts))
                        if (head, ".".join(parts[i:])) in have), None))
    if len(fewer) == 1 and None not in fewer:
        p = fewer.pop()
        return (f"every missing key is a checkpoint key with the prefix {p!r} added (e.g. {missing[0]!r}): the state "
                f"comes from a wrapped model (DDP 'module.', torch.compile '_orig_mod.'); load into the unwrapped "
                f"model's state_dict() (model.module / model._orig_mod)")
    return ""


def _raise_mismatch(plan: _Plan, unexpected: list[str], root: str) -> None:
    lines = []
    for key, have, stored, f in plan.mismatched:
        lines.append(f"  {key!r}: the state has {have}, the checkpoint has {stored}" + (f" in {f!r}" if f else ""))
    for k in plan.missing[:20]:
        if k in plan.sharded_subtrees:
            lines.append(f"  {k!r}: empty in the state, the checkpoint holds tensors saved from DTensors under it (a "
                         "fresh sharded optimizer: build the state with torch.distributed.checkpoint.state_dict."
                         "get_state_dict(model, optim), whose optimizer state holds the tensors to fill)")
        else:
            lines.append(f"  missing from the checkpoint: {k!r}{plan.rank_local_hint(k)}")
    for k in unexpected[:20]:
        lines.append(f"  not in the state: {k!r}")
    others = [k for k in plan.unexpected() if k not in unexpected]  # not listed above (strict is not True)
    if plan.missing and others:
        lines.append(f"  the checkpoint holds instead (not read): {', '.join(map(repr, others[:5]))}"
                     + (f" and {len(others) - 5} more" if len(others) > 5 else ""))
    hint = _prefix_hint(plan.missing, unexpected or others)
    if hint:
        lines.append(f"  {hint}")
    more = len(plan.missing) + len(unexpected) - min(len(plan.missing), 20) - min(len(unexpected), 20)
    raise StateMismatchError(
        f"{root}: the state does not match the checkpoint ({len(plan.mismatched)} mismatched, {len(plan.missing)} "
        f"missing, {len(unexpected)} unexpected); nothing was written:\n" + "\n".join(lines)
        + (f"\n  ... and {more} more" if more > 0 else "")
        + "\nBuild the state from the same model/optimizer config (FSDP2 / DTensor states: "
        "torch.distributed.checkpoint.state_dict.get_state_dict)"
        + (", or pass strict=False to leave the missing keys untouched." if plan.missing and not plan.mismatched
           else "; a tensor of another shape is never loaded." if plan.mismatched else
           ", or drop strict=True to ignore the checkpoint keys the state does not name."),
        path=root, missing=plan.missing, unexpected=unexpected, mismatched=plan.mismatched)


class Files:
    """Open read fds by path (thread-safe), closed together by :meth:`close`."""

    def __init__(self, be: PosixBackend):
        self.be, self.fds, self.lock = be, {}, threading.Lock()

    def fd(self, path: str) -> int:
        """The read fd of ``path``, opened on first use."""
        with self.lock:
            if path not in self.fds:
                self.fds[path] = self.be.open_read(path)
            return self.fds[path]

    def close(self) -> None:
        """Close every fd opened."""
        for fd in self.fds.values():
            self.be.close(fd)


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (same memory)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def read_box(files: Files, ex: ThreadPoolExecutor, parts: list[tuple[Stored, Box]], dst: Box,
             out: memoryview, chunk: int, key: str) -> None:
    """Read the bytes of global box ``dst`` from ``parts`` (stored piece, box of it inside ``dst``) into
    ``out``, a C-order buffer of ``dst``; requests of at most ``chunk`` bytes run on ``ex``."""
    futs = []
    for st, b in parts:
        for run in split_runs(box_runs(st, b, dst), chunk):
            futs.append(ex.submit(_read_run, files, run, out, key))
    for f in futs:
        f.result()


def _read_run(files: Files, run: ByteRun, out: memoryview, key: str) -> None:
    readv_exact(files.be, files.fd(run.file), [out[run.dst_offset:run.dst_offset + run.nbytes]], run.file_offset,
                path=run.file, what=key)


def _fill(t: FillTarget, files: Files, ex: ThreadPoolExecutor, chunk: int, buffer_bytes: int) -> list:
    """Fill one target; returns the futures of a direct read (the caller waits), [] when done here."""
    loc = t.local
    if loc.device.type == "cpu" and loc.is_contiguous() and t.stored is None:
        out = byte_view(loc)
        return [ex.submit(_read_run, files, run, out, t.key)
                for st, b in t.parts for run in split_runs(box_runs(st, b, t.region), chunk)]
    isz = t.desc.pieces[0].itemsize
    for blk in dim0_blocks(t.region, buffer_bytes, isz):
        tmp = torch.empty(blk[1], dtype=t.stored or loc.dtype)  # the stored dtype: copy_ below casts
        parts = [(st, b) for st, _ in t.parts if (b := intersect(st.box, blk)) is not None]
        read_box(files, ex, parts, blk, byte_view(tmp), chunk, t.key)
        sl = tuple(slice(o - r, o - r + n) for o, n, r in zip(blk[0], blk[1], t.region[0]))
        loc[sl].copy_(tmp) if sl else loc.copy_(tmp.reshape(loc.shape))
    return []


def verify_region(key: str, checks: list[RangeCheck], stored: Stored, local: torch.Tensor, region: Box,
                  files: Files, ex: ThreadPoolExecutor, chunk: int) -> None:
    """Check every checksummed element box of ``checks`` (of the tensor stored as ``stored``) that
    overlaps ``region`` (held by ``local``): from ``local`` when the region covers the box, else by
    reading the whole box from its file.

    Raises:
        ChecksumMismatchError: names the key, the chunk (offsets, shape) and the file.
    """
    for c in checks:
        box = c.elements
        if math.prod(region[1]) == 0 or intersect(box, region) is None:
            continue
        if contains(region, box):
            data = box_bytes(local, box, region[0])
        else:
            tmp = torch.empty(box[1], dtype=local.dtype)
            read_box(files, ex, [(stored, box)], box, byte_view(tmp), chunk, key)
            data = byte_view(tmp)
        problem = chunk_problem(key, stored.file, box, c.xxh3, data)
        if problem:
            raise ChecksumMismatchError(f"{c.what}: {problem}", path=stored.file, tensor=key)


def _verify_cast(t: FillTarget, files: Files, ex: ThreadPoolExecutor, chunk: int) -> None:
    """:func:`verify_region` for a target filled with a cast: its tensor no longer holds the stored
    bytes, so each checksummed box overlapping the region is read again (stored dtype) and hashed.

    Raises:
        ChecksumMismatchError: names the key, the chunk and the file.
    """
    stored = t.desc.pieces[0]
    for c in t.desc.checks:
        box = c.elements
        if math.prod(t.region[1]) == 0 or intersect(box, t.region) is None:
            continue
        tmp = torch.empty(box[1], dtype=t.stored)
        read_box(files, ex, [(stored, box)], box, byte_view(tmp), chunk, t.key)
        problem = chunk_problem(t.key, stored.file, box, c.xxh3, byte_view(tmp))
        if problem:
            raise ChecksumMismatchError(f"{c.what}: {problem}", path=stored.file, tensor=t.key)


def _verify_targets(targets: list[FillTarget], files: Files, ex: ThreadPoolExecutor, chunk: int) -> None:
    """Check the filled targets' checksums, several tensors hashed at once (xxhash releases the GIL);
    reads of partly covered boxes go to ``ex``. Raises the first failure in target order."""
    def one(t: FillTarget) -> None:
        if t.stored is None:
            verify_region(t.key, t.desc.checks, t.desc.pieces[0], t.local, t.region, files, ex, chunk)
        else:
            _verify_cast(t, files, ex, chunk)

    todo = [t for t in targets if t.desc.checks]
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1, 8)), thread_name_prefix="fastckpt-hash") as hx:
        futs = [hx.submit(one, t) for t in todo]
        for f in futs:
            f.result()


def _log_keys(plan: _Plan, unexpected: list[str], root: str) -> None:
    """Keys left unfilled are never silent: WARNING for missing ones, INFO for ignored and cast ones."""
    if plan.missing:
        logger.warning("fastckpt: load_into(%s, strict=False) left %d key(s) of the state untouched (not in the "
                       "checkpoint): %s%s", root, len(plan.missing), plan.missing[:10],
                       " ..." if len(plan.missing) > 10 else "")
    if unexpected:
        logger.info("fastckpt: load_into(%s) ignored %d checkpoint key(s) the state does not name: %s%s", root,
                    len(unexpected), unexpected[:10], " ..." if len(unexpected) > 10 else "")
    truncated = [c for c in plan.cast if c[1].startswith(("F", "BF", "C")) and not c[2].startswith(("F", "BF", "C"))]
    if truncated:  # as torch's copy_ (load_state_dict, DCP): cast, but a float read into an int or bool is rarely meant
        logger.warning("fastckpt: load_into(%s) cast %d floating tensor(s) into the state's integer/bool tensors "
                       "(values truncated, as torch's copy_ does; key, stored, state): %s%s", root, len(truncated),
                       truncated[:10], " ..." if len(truncated) > 10 else "")
    if plan.cast:
        logger.info("fastckpt: load_into(%s) cast %d tensor(s) to the state's dtype (key, stored, state): %s%s",
                    root, len(plan.cast), plan.cast[:10], " ..." if len(plan.cast) > 10 else "")


def _default_rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (ImportError, RuntimeError):
        return 0


def load_into(state: Any, path: str | os.PathLike, *, strict: bool | None = None, verify: bool = True,
              threads: int | None = None, io_backend: str | PosixBackend | None = None,
              chunk_bytes: int = READ_CHUNK_BYTES, buffer_bytes: int = BUFFER_BYTES,
              local_rank: int | None = None, report: LoadIntoReport | None = None) -> Any:
    """Fill the tensors of ``state`` in place from the checkpoint at ``path``, resharding as needed.

    ``state`` is a nested dict/list/tuple like the one saved, e.g. ``{"model": model.state_dict(),
    "optim": optim_sd}``; as with ``torch.distributed.checkpoint.load``, the state names what is
    loaded: ``load_into({"model": model.state_dict()}, ckpt)`` of a checkpoint that also holds the
    optimizer reads the model only. Each tensor leaf is matched by key path
    (:mod:`fastckpt.format.tree`, e.g. ``"model/lm_head.weight"``) and filled in place:

    * plain CPU/accelerator tensors, ``nn.Parameter`` values and NumPy arrays: the whole tensor;
    * ``DTensor`` (FSDP2 ``fully_shard``, TP; any mesh, ``Shard(d)``, uneven shards, ``Replicate``):
      its ``to_local()`` gets the global region of this rank, and only the bytes of that region are
      read (a ``Shard(0)`` region of a full tensor is one byte run, ``Shard(1)`` one run per row).

    Dtypes follow DCP's ``FileSystemReader`` (``target.copy_(stored)``): a stored tensor whose dtype
    differs from the state's (fp32 checkpoint into a bf16 model, bf16 into fp32...) is read in its
    stored dtype and cast with ``copy_``, so the state holds exactly ``stored.to(state_dtype)``; the
    bytes are never reinterpreted. A tensor of another shape is always refused.

    No collective is made: every rank may call it with its own state. Any world size loads any other:
    the sources are fastckpt checkpoints of format 1 (one process, or multi-rank with rank-local
    subtrees) and format 2 (full tensors with per-chunk checksums), and plain HF folders / safetensors files.

    HF folders (no manifest; ``model.safetensors``, sharded with an index, hub snapshot folders):
    a tensor leaf matches the stored tensor named by the longest suffix of its key's dotted parts
    (the key segments split at ``.``); so ``load_into(model.state_dict(), hf_dir)`` matches names
    directly, ``load_into({"model": model.state_dict()}, hf_dir)`` drops the ``"model"`` prefix and a
    sentence-transformers ``state_dict()`` (``0.auto_model.embeddings...``) drops ``0.auto_model.``. Weights that HF
    leaves out of the files (tied ``lm_head.weight`` when ``tie_word_embeddings``; the duplicates
    ``safetensors.torch.save_model`` drops) are filled through their tie when the state's tensor shares
    its memory with one that is filled (``model.state_dict()`` of a tied model), as ``from_pretrained``
    and ``safetensors.torch.load_model`` accept them; otherwise they are missing keys.

    A top-level value with ``state_dict()`` / ``load_state_dict()`` (DCP's ``Stateful``, e.g. the DCP
    tutorial's ``{"app": AppState(model, optimizer)}``, an ``nn.Module``) is loaded as ``dcp.load``
    does: its ``state_dict()`` is the template filled, then ``load_state_dict(filled)`` is called and
    the object itself is returned under its key. ``state`` may also be such an object itself
    (``load_into(model, "hf_dir")``, as ``safetensors.torch.load_model(model, file)``): it is filled
    the same way and returned.

    Non-tensor leaves (ints, floats, strings, ``None``, optimizer ``param_groups`` values, empty
    containers) are replaced in the *returned* tree by the checkpoint's values (the input containers
    are not modified); tensor leaves are the very objects passed in. An empty container where the
    checkpoint holds a subtree (a fresh optimizer's ``state: {}``, before its first step) is replaced
    by that subtree, read into new CPU tensors, so ``opt.load_state_dict(out["optim"])`` restores it
    as after ``torch.load``; not when the subtree was saved from DTensors (use ``get_state_dict``,
    whose optimizer state holds the tensors to fill: it stays a missing key).

    Args:
        state: the nested state to fill (tensor leaves must be allocated, not on the meta device).
        path: checkpoint folder, HF model folder or safetensors file.
        strict: which disagreements of keys raise :class:`~fastckpt.errors.StateMismatchError`
            (before any tensor is written):

            * ``None`` (default, as ``dcp.load``): a key of the state that the checkpoint lacks
              raises; checkpoint keys the state does not name are ignored (not read; logged at INFO,
              listed in ``report.unexpected_keys``).
            * ``True`` (as ``nn.Module.load_state_dict(strict=True)``): both directions raise.
            * ``False`` (as ``dcp.load`` with ``DefaultLoadPlanner(allow_partial_load=True)``): state
              keys the checkpoint lacks are left untouched, never silently: logged as a WARNING naming
              them and listed in ``report.missing_keys``.

            In every mode a tensor of another shape, or a tensor where the checkpoint holds a plain
            value (or the reverse), raises.
        verify: check the xxh3 checksums of what is read (fastckpt checkpoints; default ``True``,
            ``False`` skips it; HF folders carry none): a whole-tensor checksum, a v2 chunk or a v1
            shard piece fully inside this rank's region is hashed from the filled tensor; one that the
            region covers only partly is read whole from the file and hashed (so verify may read up
            to a chunk more than the region; a checkpoint saved by one process has one checksum per
            tensor, so each rank of a sharded state reads the tensors it holds part of whole once
            more); a tensor filled with a cast is read once more in its stored dtype and hashed.
        threads: reads in flight (default :func:`fastckpt.loading.reader.default_read_threads`).
        io_backend: I/O backend name or instance (default ``"posix"``).
        chunk_bytes: bytes per read request (default 4 MiB).
        buffer_bytes: host bounce memory per tensor for destinations that are not contiguous CPU
            tensors of the stored dtype (accelerator tensors, strided views, a dtype cast), default
            64 MiB; at least one dim-0 slice.
        local_rank: saved rank whose rank-local subtrees (a multi-rank save's ``local_keys``, which
            carry no placement and do not reshard) fill the state's. Default: this process's rank in
            the default process group when one is initialized, else 0.
        report: a :class:`LoadIntoReport` to fill with the missing, unexpected and cast keys (as
            ``nn.Module.load_state_dict`` returns missing/unexpected keys); default ``None``.

    Returns:
        ``state`` rebuilt with the same containers: tensor leaves are the filled objects, non-tensor
        leaves the checkpoint's values.

    Peak memory: the state itself plus, per bounced tensor, ``buffer_bytes`` (at least one dim-0
    slice); with ``verify``, a chunk that a region covers only partly (or that was cast) is read into
    a temporary.

    Raises:
        InvalidArgumentError: ``state`` is none of those (a path given as the state), or a bad option.
        StateMismatchError: keys disagree as ``strict`` forbids, or a shape / tensor-vs-value
            disagreement (names key, both shapes and dtypes, and the file); nothing written.
        CheckpointNotFoundError, HeaderError, CorruptCheckpointError, UnsafePathError: as
            :func:`fastckpt.load`, before anything is written (CorruptCheckpointError also when the
            stored shard pieces do not cover a region).
        UnsupportedDtypeError: the file names a dtype torch does not have (names key and file).
        ChecksumMismatchError: with ``verify``, bytes read differ from the manifest (names the key,
            the chunk offsets and the file); tensors filled before the check keep the bytes read.
        InvalidArgumentError: (a ``ValueError``) a DTensor whose local shape disagrees with its
            placements, or a tensor on the meta device.
        OSError: from the reads.

    Example::

        sd, osd = get_state_dict(model, optim)       # FSDP2: DTensor values
        state = fastckpt.load_into({"model": sd, "optim": osd}, "ckpt/step-100")
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

        rep = fastckpt.LoadIntoReport()                 # weights only, tied lm_head left to the embedding
        fastckpt.load_into(model.state_dict(), "hf_model/", strict=False, report=rep)  # rep.missing_keys
    """
    if strict not in (None, True, False):
        raise InvalidArgumentError(f"strict must be None, True or False, got {strict!r}")
    if not isinstance(state, (dict, list, tuple)) and not is_stateful(state):
        raise InvalidArgumentError(
            f"state must be what to fill in place: a dict/list/tuple of tensors (model.state_dict(), "
            f"{{'model': ..., 'optim': ...}}), a module, an optimizer or a DCP Stateful; got a "
            f"{type(state).__name__}: {state!r:.80}. To read a checkpoint into new tensors use fastckpt.load(path)")
    check_threads(threads)
    check_byte_options(chunk_bytes=chunk_bytes, buffer_bytes=buffer_bytes)
    check_flags(verify=verify)
    if is_url(path):  # a non-local store (s3://...): read a local copy (Store.local_folder)
        with store_for(path).local_folder(path) as local:
            return load_into(state, local, strict=strict, verify=verify, threads=threads, io_backend=io_backend,
                             chunk_bytes=chunk_bytes, buffer_bytes=buffer_bytes, local_rank=local_rank,
                             report=report)
    if not isinstance(state, (dict, list, tuple)) and is_stateful(state):  # a module / optimizer itself
        filled = load_into(state.state_dict(), path, strict=strict, verify=verify, threads=threads,
                           io_backend=io_backend, chunk_bytes=chunk_bytes, buffer_bytes=buffer_bytes,
                           local_rank=local_rank, report=report)
        state.load_state_dict(filled)
        return state
    state, stateful = to_state_dicts(state)  # DCP's Stateful: fill obj.state_dict(), then obj.load_state_dict()
    if local_rank is None:
        local_rank = _default_rank()
    idx = open_index(path, local_rank)
    plan = _Plan(idx)
    if not idx.is_fastckpt:
        plan.hf_names = _hf_names(idx, state)
    for v, p, segs in _leaves(state):
        plan.leaf(v, p, segs)
    for keys, differ in plan.fill_ties_once():
        if differ is not False:
            logger.log(logging.WARNING if differ else logging.INFO,
                "fastckpt.load_into %s: the state ties %s (one memory) and the checkpoint holds %s for them; "
                "filled from %r, the last key, as load_state_dict does. A checkpoint of an untied model into a "
                "tied one loses the other values: untie the model (config tie_word_embeddings=False) to keep both",
                idx.resolved.root, keys, "different values" if differ else "each (its values not compared: no "
                "checksums)", keys[-1])
    tied = plan.tied()
    if tied:
        logger.info("fastckpt.load_into %s: %d tensor(s) filled through their tie (they share memory with a "
                    "tensor the checkpoint holds): %s", idx.resolved.root, len(tied), tied[:10])
    unexpected = plan.unexpected()
    if plan.mismatched or (plan.missing and strict is not False) or (unexpected and strict is True):
        _raise_mismatch(plan, unexpected if strict else [], idx.resolved.root)
    _log_keys(plan, unexpected, idx.resolved.root)
    if report is not None:
        report.missing_keys[:] = plan.missing
        report.unexpected_keys[:] = unexpected
        report.cast[:] = plan.cast
    chunk = max(4096, int(chunk_bytes))
    files = Files(get_backend(io_backend))
    try:
        with ThreadPoolExecutor(threads or default_read_threads(), thread_name_prefix="fastckpt-into") as ex:
            futs = []
            for t in plan.targets:
                futs += _fill(t, files, ex, chunk, max(1, int(buffer_bytes)))
            for f in futs:
                f.result()
            for t in plan.targets:
                torch.autograd.graph.increment_version(t.local)  # written behind autograd's back
            if verify and any(t.desc.checks for t in plan.targets):
                _verify_targets(plan.targets, files, ex, chunk)
    finally:
        files.close()
    if plan.subtrees or plan.views:  # empty containers taking stored subtrees, strided views: one read
        read = read_subtrees(idx.resolved.root, [*plan.subtrees.values(), *(n for _, n in plan.views.values())],
                             verify=verify, threads=threads, io_backend=io_backend)
        for at, name in plan.subtrees.items():
            plan.values[at] = read[name]
        for v, name in plan.views.values():
            local, (off, shape), _ = local_region(v)
            with torch.no_grad():
                local.copy_(read[name][tuple(slice(o, o + n) for o, n in zip(off, shape))])
            torch.autograd.graph.increment_version(local)
    return load_back(_rebuild(state, "", plan.values), stateful)
