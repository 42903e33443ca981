"""A ``torch.distributed.checkpoint`` StorageReader over fastckpt's read path, and a load planner
that never unpickles.

``dcp.load(state, storage_reader=FastCkptReader(path))`` (DCP's ``DefaultLoadPlanner``, a subclass
of it, or :class:`FastCkptLoadPlanner`) reads a fastckpt checkpoint (format 1, one or many ranks,
or 2) or a plain HF folder, with DCP's planner deciding placement and resharding. Nothing is
unpickled and no ``.metadata`` file is needed:

* :meth:`FastCkptReader.read_metadata` builds DCP's ``Metadata`` from the manifest
  (``TensorStorageMetadata``: one chunk per full tensor; non-tensor values: ``BytesStorageMetadata``, whose values stay in ``Metadata.storage_data``
  as the JSON values of ``state.json``: a value DCP takes whole that holds tensors, such as a tuple
  ``(1.5, tensor)`` (DCP's flattening stops at tuples and pickles them), is read from the checkpoint
  when it is set, tensors included; ``planner_data``: DCP's ``flatten_state_dict`` mapping of
  the saved state; ``storage_meta``: from ``dcp_metadata.json`` when the writer left one, whose
  fqns, dtypes and sizes the rebuilt metadata is checked against).
* Non-tensor (BYTE_IO) reads: DCP's default planner would ``torch.load(weights_only=False)`` the
  bytes; instead the reader sets the JSON value where ``DefaultLoadPlanner.load_bytes`` puts it
  (the same element of the caller's state), and :class:`FastCkptLoadPlanner` sets them while
  planning. A planner that overrides ``load_bytes`` is refused
  (:class:`~fastckpt.errors.DCPPlannerError`, before any tensor is read): it expects pickled bytes.
* :meth:`FastCkptReader.read_data` reads each ``ReadItem``'s region (``storage_offsets`` /
  ``lengths`` within the stored chunk) with :func:`fastckpt.loading.into.read_box`, straight into
  the destination when it is a contiguous CPU tensor of the stored dtype; a destination of another
  dtype gets the stored values cast, ``target.copy_(stored)``, as DCP's ``FileSystemReader`` does
  (never the bytes reinterpreted); then hands it to the planner.

Call order (DCP's ``StorageReader`` contract, every rank unless said): ``reset`` -> ``read_metadata``
-> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator) ->
``read_data``.
"""

from __future__ import annotations

import copy
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader
from torch.futures import Future
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError, DCPPlannerError
from ..format.dtypes import str_to_dtype
from ..format.tree import join
from ..storage.io import PosixBackend, get_backend
from ..storage.store import LOCAL
from .into import Files, byte_view, read_box, verify_region
from .reader import READ_CHUNK_BYTES, default_read_threads, read_subtrees
from .regions import Stored, intersect
from .stored import CheckpointIndex, Leaf, TensorDesc, open_index


@dataclass
class FastCkptStorageData:
    """``Metadata.storage_data`` of a :class:`FastCkptReader`.

    Attributes:
        values: DCP fqn -> non-tensor value (JSON values of ``state.json``, never pickled).
        chunks: ``(fqn, chunk offsets)`` -> the stored tensor or piece holding that chunk.
        descs: fqn -> the checkpoint's :class:`~fastckpt.loading.stored.TensorDesc`.
        root: the checkpoint's folder (where a :class:`StoredSubtree` value is read from).
    """

    values: dict[str, Any] = field(default_factory=dict)
    chunks: dict[tuple[str, tuple[int, ...]], Stored] = field(default_factory=dict)
    descs: dict[str, TensorDesc] = field(default_factory=dict)
    root: str = ""

    def value(self, fqn: str) -> Any:
        """A fresh copy of the non-tensor value of ``fqn``; a :class:`StoredSubtree` is read from
        :attr:`root` (its tensors included, checksums verified)."""
        v = self.values[fqn]
        if isinstance(v, StoredSubtree):
            return v.read(self.root)
        return copy.deepcopy(v)


@dataclass(frozen=True)
class StoredSubtree:
    """A value DCP takes whole (a terminal of its ``flatten_state_dict``: a tuple, or anything in
    one) that holds stored tensors: its key path ``path`` in the checkpoint, read when the value is
    set (:meth:`FastCkptStorageData.value`). Plain data, so DCP's broadcast of the metadata to
    other ranks carries it."""

    path: str

    def read(self, root: str) -> Any:
        """The subtree at :attr:`path` of the checkpoint at ``root``, as :func:`fastckpt.load` returns it."""
        return read_subtrees(root, [self.path])[self.path]


def _holds_marked(v: Any, marks: dict[int, str]) -> bool:
    """True when ``v`` (a value DCP takes whole) holds one of the marked stand-ins of stored tensors."""
    if isinstance(v, torch.Tensor):
        return id(v) in marks
    if isinstance(v, dict):
        return any(_holds_marked(x, marks) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_marked(x, marks) for x in v)
    return False


def _marked(v: Any, path: str, marks: dict[int, str]) -> Any:
    """The saved state with each tensor replaced by an empty meta tensor
    whose ``id`` maps to its key path in ``marks``, rank-local subtrees left out: DCP's own
    flattening of it then names the fqns exactly as it names the caller's state."""
    if isinstance(v, Leaf):
        t = torch.empty(0, device="meta")
        marks[id(t)] = path
        return t
    if isinstance(v, dict):
        return {k: _marked(x, join(path, k), marks) for k, x in v.items()
                if not (isinstance(x, dict) and len(x) == 1 and "__rank_local__" in x)}
    if isinstance(v, list):
        return [_marked(x, join(path, i), marks) for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return tuple(_marked(x, join(path, i), marks) for i, x in enumerate(v))
    return v


def build_metadata(idx: CheckpointIndex) -> Metadata:
    """DCP ``Metadata`` of a checkpoint (no pickle): fqns as DCP's ``flatten_state_dict`` names the
    saved state (``model.lm_head.weight``, ``optim.state.lm_head.weight.exp_avg``...)."""
    marks: dict[int, str] = {}
    tree = _marked(idx.tree, "", marks)
    if not isinstance(tree, dict):
        raise DCPPlannerError(f"{idx.resolved.root}: the saved state is a {type(tree).__name__}, not a dict; "
                              "DCP loads dict states only")
    flat, mappings = flatten_state_dict(tree)
    sd = FastCkptStorageData(root=idx.resolved.root)
    md: dict[str, Any] = {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor) and id(v) in marks:
            desc = idx.tensors[marks[id(v)]]
            chunks = []
            for st in desc.pieces:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(st.origin), sizes=torch.Size(st.shape)))
                sd.chunks[(fqn, tuple(st.origin))] = st
            sd.descs[fqn] = desc
            md[fqn] = TensorStorageMetadata(TensorProperties(dtype=str_to_dtype(desc.dtype, tensor=desc.key)),
                                            torch.Size(desc.shape), chunks)
        else:  # a JSON value, or one DCP takes whole with tensors in it (read when set)
            path = ""
            for seg in mappings[fqn]:
                path = join(path, seg)
            sd.values[fqn] = StoredSubtree(path) if _holds_marked(v, marks) else v
            md[fqn] = BytesStorageMetadata()
    meta = Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=sd)
    saved = _saved_dcp_metadata(idx)
    if saved is not None:
        _check_saved(idx, meta, saved)
        sm = saved.get("storage_meta") or {}
        meta.storage_meta = StorageMeta(checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"),
                                        modules=list(sm.get("modules") or []))
        meta.version = saved.get("dcp_version")
    return meta


#: Written by :class:`fastckpt.dcp.FastCkptWriter` for plans of DCP's own planners (its ``DCP_METADATA``).
DCP_METADATA = "dcp_metadata.json"


def _saved_dcp_metadata(idx: CheckpointIndex) -> dict | None:
    """``dcp_metadata.json`` of a fastckpt checkpoint (JSON, listed in its manifest), or ``None``."""
    m = idx.resolved.manifest
    if m is None or DCP_METADATA not in m.files or LOCAL.isfile(idx.resolved.root):
        return None
    path = os.path.join(idx.resolved.root, DCP_METADATA)
    try:
        doc = json.loads(LOCAL.read_bytes(path))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: listed in the manifest but unreadable ({e}); run "
                                     f"`fastckpt verify {idx.resolved.root}`") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("state_dict_metadata"), dict):
        raise CorruptCheckpointError(f"{path}: not a fastckpt DCP metadata document")
    return doc


def _check_saved(idx: CheckpointIndex, meta: Metadata, saved: dict) -> None:
    """The metadata rebuilt from the manifest names every fqn the save's DCP metadata named, with the
    same kind, dtype and global size.

    Raises:
        CorruptCheckpointError: names the fqn and both descriptions.
    """
    where = os.path.join(idx.resolved.root, DCP_METADATA)
    for fqn, d in saved["state_dict_metadata"].items():
        got = meta.state_dict_metadata.get(fqn)
        if d.get("type") == "tensor":
            ok = isinstance(got, TensorStorageMetadata) and list(got.size) == list(d["size"]) and \
                got.properties.dtype == str_to_dtype(d["dtype"], tensor=fqn)
            want = f"a {d['dtype']} tensor of size {d['size']}"
        else:
            ok, want = isinstance(got, BytesStorageMetadata), "a non-tensor value"
        if not ok:
            have = "missing" if got is None else (f"a {got.properties.dtype} tensor of size {list(got.size)}"
                                                   if isinstance(got, TensorStorageMetadata) else "a non-tensor value")
            raise CorruptCheckpointError(f"{where}: the save's DCP metadata has {fqn!r} as {want}; the manifest and "
                                         f"state.json give {have}. Run `fastckpt verify {idx.resolved.root}`")


class FastCkptReader(StorageReader):
    """DCP ``StorageReader`` of a fastckpt checkpoint (format 1 or 2, any world size) or HF folder.

    Args:
        path: checkpoint folder, HF model folder or safetensors file (``checkpoint_id`` of
            ``dcp.load`` overrides it when given).
        verify: check the xxh3 of what is read (as :func:`fastckpt.load_into`'s ``verify``; default
            ``True``: a resume through DCP, the torchtitan manager's included, never returns a flipped
            byte as a weight; ``False`` skips it).
        threads: reads in flight (default :func:`fastckpt.loading.reader.default_read_threads`).
        io_backend: I/O backend name or instance (default ``"posix"``).
        chunk_bytes: bytes per read request (default 4 MiB).

    Works with DCP's ``DefaultLoadPlanner`` (the default of ``dcp.load``), planners that subclass it
    and :class:`FastCkptLoadPlanner`. A tensor of the state whose dtype differs from the stored one
    gets the stored values cast to its dtype (``target.copy_(stored)``, as DCP's ``FileSystemReader``);
    shapes are checked by DCP's planner (its ``ValueError`` "Size mismatch", wrapped by DCP).

    Raises (from DCP's calls, wrapped by DCP in its ``CheckpointException``):
        DCPPlannerError: a non-tensor (BYTE_IO) item the checkpoint has no JSON value for, or a planner
            that overrides ``load_bytes`` (it expects pickled bytes); before any tensor is read.
        CheckpointNotFoundError, HeaderError, CorruptCheckpointError, ChecksumMismatchError, OSError:
            as :func:`fastckpt.load_into`.

    Example::

        dcp.load(state, storage_reader=FastCkptReader("ckpt/step-100"))
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, threads: int | None = None,
                 io_backend: str | PosixBackend | None = None, chunk_bytes: int = READ_CHUNK_BYTES):
        super().__init__()
        self.path = os.fspath(path)
        self.verify, self.threads, self.io_backend = verify, threads, io_backend
        self.chunk_bytes = max(4096, int(chunk_bytes))
        self.storage_data: FastCkptStorageData | None = None
        self.metadata_error: Exception | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new read; ``checkpoint_id`` (a path), when given, replaces the reader's path."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is an existing folder or file."""
        return LOCAL.exists(os.fspath(checkpoint_id))

    def read_metadata(self) -> Metadata:  # type: ignore[override]  (no per-rank metadata: one manifest)
        """Validate the checkpoint (headers, manifest) and return DCP ``Metadata`` built from it.

        The error of a failed read is kept as ``metadata_error`` (DCP reports only its text, as
        ``AssertionError: metadata is None``); :func:`fastckpt.dcp.load` raises it as it is.
        """
        self.metadata_error = None
        try:
            return build_metadata(open_index(self.path))
        except Exception as e:
            self.metadata_error = e
            raise

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the storage data of ``metadata`` (from :meth:`read_metadata`)."""
        if not isinstance(metadata.storage_data, FastCkptStorageData):
            raise DCPPlannerError(f"{self.path}: metadata was not built by FastCkptReader.read_metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse non-tensor reads the checkpoint has no JSON value for; otherwise unchanged."""
        _refuse_bytes(plan.items, self.path, self.storage_data)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged (every rank reads its own items)."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read every item of ``plan`` into ``planner.resolve_tensor(item)`` and commit it.

        Returns a completed future (the reads are done, in parallel, when it returns).
        """
        sd = self.storage_data
        _refuse_bytes(plan.items, self.path, sd)
        _set_values([i for i in plan.items if i.type == LoadItemType.BYTE_IO], planner, sd, self.path)
        files = Files(get_backend(self.io_backend))
        try:
            with ThreadPoolExecutor(self.threads or default_read_threads(), thread_name_prefix="fastckpt-dcp") as ex:
                for item in plan.items:
                    if item.type != LoadItemType.BYTE_IO:
                        self._read_item(item, planner, sd, files, ex)
        finally:
            files.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, item: ReadItem, planner: LoadPlanner, sd: FastCkptStorageData, files: Files,
                   ex: ThreadPoolExecutor) -> None:
        fqn = item.storage_index.fqn
        st = sd.chunks[(fqn, tuple(item.storage_index.offset))]
        box = (tuple(o + s for o, s in zip(st.origin, item.storage_offsets)), tuple(item.lengths))
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box[1]:
            raise ValueError(f"{fqn}: planner target of shape {list(target.shape)} for a read of {list(box[1])}")
        stored = str_to_dtype(sd.descs[fqn].dtype, tensor=fqn)
        if target.device.type == "cpu" and target.is_contiguous() and target.dtype == stored:
            read_box(files, ex, [(st, box)], box, byte_view(target), self.chunk_bytes, fqn)
            dest = target
        else:  # the stored bytes in their own dtype, then DCP's FileSystemReader's target.copy_(stored): a cast
            dest = torch.empty(box[1], dtype=stored)
            read_box(files, ex, [(st, box)], box, byte_view(dest), self.chunk_bytes, fqn)
            target.copy_(dest)
        if self.verify:
            checks = [c for c in sd.descs[fqn].checks if intersect(c.elements, box) is not None]
            verify_region(fqn, checks, sd.descs[fqn].pieces[0], dest, box, files, ex, self.chunk_bytes)
        torch.autograd.graph.increment_version(target)
        planner.commit_tensor(item, target)


def _refuse_bytes(items: list[ReadItem], path: str, sd: FastCkptStorageData | None) -> None:
    """Refuse BYTE_IO reads of fqns the checkpoint holds no JSON value for (nothing to unpickle, ever)."""
    values = sd.values if sd is not None else {}
    names = [i.storage_index.fqn for i in items if i.type == LoadItemType.BYTE_IO and i.storage_index.fqn not in values]
    if names:
        raise DCPPlannerError(
            f"{path}: DCP planned {len(names)} non-tensor (BYTE_IO) reads ({', '.join(map(repr, names[:5]))}"
            f"{' ...' if len(names) > 5 else ''}) that this checkpoint holds no JSON value for; fastckpt never "
            "unpickles. Load into a state whose entries the checkpoint has (fastckpt.read_manifest lists them)")


def _set_values(items: list[ReadItem], planner: LoadPlanner, sd: FastCkptStorageData, path: str) -> None:
    """Set the checkpoint's JSON value of each BYTE_IO item where ``DefaultLoadPlanner.load_bytes`` puts
    the unpickled one (the element of the caller's state at the fqn's path), never unpickling.

    Raises:
        DCPPlannerError: the planner is not a ``DefaultLoadPlanner`` or overrides ``load_bytes``.
    """
    if not items:
        return
    kind = type(planner)
    if not isinstance(planner, DefaultLoadPlanner) or kind.load_bytes is not DefaultLoadPlanner.load_bytes:
        what = "overrides load_bytes" if isinstance(planner, DefaultLoadPlanner) else "is not a DefaultLoadPlanner"
        raise DCPPlannerError(
            f"{path}: planner {kind.__module__}.{kind.__qualname__} {what}, which expects pickled bytes for the non-tensor values {[i.dest_index.fqn for i in items][:5]}; "
            "fastckpt stores them as JSON and never unpickles. Keep DefaultLoadPlanner's load_bytes (subclass "
            "without overriding it) or pass planner=fastckpt.dcp.FastCkptLoadPlanner(). Nothing was read")
    for item in items:
        fqn = item.dest_index.fqn
        value = sd.value(item.storage_index.fqn)
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value


def _numpy_as_tensors(v: Any) -> Any:
    """``v`` with every NumPy array (in dicts and lists) replaced by ``torch.from_numpy`` of it (shared
    memory); ``v`` itself when it holds none. Containers are copied only along the way to an array."""
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    if isinstance(v, dict):
        out = {k: _numpy_as_tensors(x) for k, x in v.items()}
        return v if all(out[k] is v[k] for k in v) else out
    if isinstance(v, list):
        out = [_numpy_as_tensors(x) for x in v]
        return v if all(a is b for a, b in zip(out, v)) else out
    return v


class FastCkptLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that never unpickles: non-tensor values come from
    ``state.json`` (JSON) through :class:`FastCkptReader`'s metadata and are set in the state while
    planning; the plan holds tensor reads only. Same arguments as ``DefaultLoadPlanner``
    (``flatten_state_dict``, ``flatten_sharded_tensors``, ``allow_partial_load``).

    Raises:
        DCPPlannerError: used with a reader other than :class:`FastCkptReader` that plans non-tensor
            items, or asked to ``load_bytes`` (never unpickles).
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        """DCP's set-up, with each NumPy array of ``state_dict`` planned as the tensor
        ``torch.from_numpy`` gives (its memory: the array is filled in place), as
        :class:`~fastckpt.dcp.FastCkptSavePlanner` stored it; DCP's default planner would plan it
        as a pickled value. ``state_dict`` itself keeps its arrays."""
        views = _numpy_as_tensors(state_dict)
        super().set_up_planner(views, metadata, is_coordinator)
        if views is not state_dict:
            self.original_state_dict = state_dict  # non-tensor values are set into the caller's state

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan minus BYTE_IO items, whose values are set from the metadata instead."""
        plan = super().create_local_plan()
        sd = getattr(self.metadata, "storage_data", None)
        keep = []
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                keep.append(item)
                continue
            fqn = item.dest_index.fqn
            if not isinstance(sd, FastCkptStorageData) or fqn not in sd.values:
                raise DCPPlannerError(f"non-tensor value {fqn!r}: FastCkptLoadPlanner reads non-tensor values only "
                                      "from FastCkptReader metadata (it never unpickles)")
            value = sd.value(fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], value)
            else:
                self.state_dict[fqn] = value
        return LoadPlan(keep, plan.storage_data, plan.planner_data)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Never called with :class:`FastCkptReader`; refuses to unpickle anything."""
        raise DCPPlannerError(f"{read_item.dest_index.fqn!r}: FastCkptLoadPlanner never unpickles BYTE_IO data")
