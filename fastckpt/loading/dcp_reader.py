"""A ``torch.distributed.checkpoint`` StorageReader over fastckpt's read path, and a load planner
that never unpickles.

``dcp.load(state, storage_reader=FastCkptReader(path), planner=FastCkptLoadPlanner())`` reads a
fastckpt checkpoint (format 1, one or many ranks, or 2) or a plain HF folder, with DCP's planner
deciding placement and resharding. Nothing is unpickled and no ``.metadata`` file is needed:

* :meth:`FastCkptReader.read_metadata` builds DCP's ``Metadata`` from the manifest
  (``TensorStorageMetadata``: one chunk per full tensor, or one per saved :class:`~fastckpt.Shard`
  piece; non-tensor values: ``BytesStorageMetadata``, whose values stay in ``Metadata.storage_data``
  as the JSON values of ``state.json``).
* :class:`FastCkptLoadPlanner` (a thin :class:`~torch.distributed.checkpoint.DefaultLoadPlanner`)
  puts those values straight into the state and leaves only tensor reads in the plan; DCP's default
  planner would ``torch.load(weights_only=False)`` non-tensor items, so the reader refuses BYTE_IO
  reads (:class:`~fastckpt.errors.DCPPlannerError` naming the planner to pass).
* :meth:`FastCkptReader.read_data` reads each ``ReadItem``'s region (``storage_offsets`` /
  ``lengths`` within the stored chunk) with :func:`fastckpt.loading.into.read_box`, straight into
  the destination when it is a contiguous CPU tensor, and hands it to the planner.

Call order (DCP's ``StorageReader`` contract, every rank unless said): ``reset`` -> ``read_metadata``
-> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator) ->
``read_data``.
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader
from torch.futures import Future
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import DCPPlannerError
from ..format.dtypes import str_to_dtype
from ..format.tree import join
from ..storage.io import PosixBackend, get_backend
from .into import Files, byte_view, read_box, verify_region
from .reader import READ_CHUNK_BYTES, default_read_threads
from .regions import Stored, intersect
from .stored import CheckpointIndex, Leaf, TensorDesc, open_index


@dataclass
class FastCkptStorageData:
    """``Metadata.storage_data`` of a :class:`FastCkptReader`.

    Attributes:
        values: DCP fqn -> non-tensor value (JSON values of ``state.json``, never pickled).
        chunks: ``(fqn, chunk offsets)`` -> the stored tensor or piece holding that chunk.
        descs: fqn -> the checkpoint's :class:`~fastckpt.loading.stored.TensorDesc`.
    """

    values: dict[str, Any] = field(default_factory=dict)
    chunks: dict[tuple[str, tuple[int, ...]], Stored] = field(default_factory=dict)
    descs: dict[str, TensorDesc] = field(default_factory=dict)


def _marked(v: Any, path: str, marks: dict[int, str]) -> Any:
    """The saved state with each tensor (and shard placeholder) replaced by an empty meta tensor
    whose ``id`` maps to its key path in ``marks``, rank-local subtrees left out: DCP's own
    flattening of it then names the fqns exactly as it names the caller's state."""
    if isinstance(v, Leaf) or (isinstance(v, dict) and len(v) == 1 and "__shard__" in v):
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
    flat, _ = flatten_state_dict(tree)
    sd = FastCkptStorageData()
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
        else:
            sd.values[fqn] = v
            md[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md, storage_data=sd)


class FastCkptReader(StorageReader):
    """DCP ``StorageReader`` of a fastckpt checkpoint (format 1 or 2, any world size) or HF folder.

    Args:
        path: checkpoint folder, HF model folder or safetensors file (``checkpoint_id`` of
            ``dcp.load`` overrides it when given).
        verify: check the xxh3 of what is read (as :func:`fastckpt.load_into`'s ``verify``).
        threads: reads in flight (default :func:`fastckpt.loading.reader.default_read_threads`).
        io_backend: I/O backend name or instance (default ``"posix"``).
        chunk_bytes: bytes per read request (default 4 MiB).

    Raises (from DCP's calls, wrapped by DCP in its ``CheckpointException``):
        DCPPlannerError: a non-tensor (BYTE_IO) item is to be read: the caller did not pass
            ``planner=FastCkptLoadPlanner()`` (raised from ``prepare_local_plan``, before any read).
        CheckpointNotFoundError, HeaderError, CorruptCheckpointError, ChecksumMismatchError, OSError:
            as :func:`fastckpt.load_into`.

    Example::

        dcp.load(state, storage_reader=FastCkptReader("ckpt/step-100"), planner=FastCkptLoadPlanner())
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = False, threads: int | None = None,
                 io_backend: str | PosixBackend | None = None, chunk_bytes: int = READ_CHUNK_BYTES):
        super().__init__()
        self.path = os.fspath(path)
        self.verify, self.threads, self.io_backend = verify, threads, io_backend
        self.chunk_bytes = max(4096, int(chunk_bytes))
        self.storage_data: FastCkptStorageData | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new read; ``checkpoint_id`` (a path), when given, replaces the reader's path."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is an existing folder or file."""
        return os.path.exists(os.fspath(checkpoint_id))

    def read_metadata(self) -> Metadata:  # type: ignore[override]  (no per-rank metadata: one manifest)
        """Validate the checkpoint (headers, manifest) and return DCP ``Metadata`` built from it."""
        return build_metadata(open_index(self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the storage data of ``metadata`` (from :meth:`read_metadata`)."""
        if not isinstance(metadata.storage_data, FastCkptStorageData):
            raise DCPPlannerError(f"{self.path}: metadata was not built by FastCkptReader.read_metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse non-tensor reads (they need :class:`FastCkptLoadPlanner`); otherwise unchanged."""
        _refuse_bytes(plan.items, self.path)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged (every rank reads its own items)."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read every item of ``plan`` into ``planner.resolve_tensor(item)`` and commit it.

        Returns a completed future (the reads are done, in parallel, when it returns).
        """
        _refuse_bytes(plan.items, self.path)
        sd = self.storage_data
        files = Files(get_backend(self.io_backend))
        try:
            with ThreadPoolExecutor(self.threads or default_read_threads(), thread_name_prefix="fastckpt-dcp") as ex:
                for item in plan.items:
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
        if target.device.type == "cpu" and target.is_contiguous():
            read_box(files, ex, [(st, box)], box, byte_view(target), self.chunk_bytes, fqn)
            dest = target
        else:
            dest = torch.empty(box[1], dtype=target.dtype)
            read_box(files, ex, [(st, box)], box, byte_view(dest), self.chunk_bytes, fqn)
            target.copy_(dest)
        if self.verify:
            checks = [c for c in sd.descs[fqn].checks if intersect(c.box, box) is not None]
            verify_region(fqn, checks, dest, box, files, ex, self.chunk_bytes)
        torch.autograd.graph.increment_version(target)
        planner.commit_tensor(item, target)


def _refuse_bytes(items: list[ReadItem], path: str) -> None:
    names = [i.dest_index.fqn for i in items if i.type == LoadItemType.BYTE_IO]
    if names:
        raise DCPPlannerError(
            f"{path}: DCP planned {len(names)} non-tensor (BYTE_IO) reads ({', '.join(map(repr, names[:5]))}"
            f"{' ...' if len(names) > 5 else ''}); DCP's default load planner would unpickle them "
            "(torch.load(weights_only=False)). Pass planner=fastckpt.dcp.FastCkptLoadPlanner(), which puts the "
            "checkpoint's JSON values in place without unpickling")


class FastCkptLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that never unpickles: non-tensor values come from
    ``state.json`` (JSON) through :class:`FastCkptReader`'s metadata and are set in the state while
    planning; the plan holds tensor reads only. Same arguments as ``DefaultLoadPlanner``
    (``flatten_state_dict``, ``flatten_sharded_tensors``, ``allow_partial_load``).

    Raises:
        DCPPlannerError: used with a reader other than :class:`FastCkptReader` that plans non-tensor
            items, or asked to ``load_bytes`` (never unpickles).
    """

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
            value = copy.deepcopy(sd.values[fqn])
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], value)
            else:
                self.state_dict[fqn] = value
        return LoadPlan(keep, plan.storage_data, plan.planner_data)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Never called with :class:`FastCkptReader`; refuses to unpickle anything."""
        raise DCPPlannerError(f"{read_item.dest_index.fqn!r}: FastCkptLoadPlanner never unpickles BYTE_IO data")
