"""fastckpt on torch.distributed.checkpoint (DCP): a save planner, a ``StorageWriter``, an ``AsyncStager``.

``dcp.save(state, storage_writer=FastCkptWriter(path))`` (DCP's ``DefaultSavePlanner``, a subclass
of it, or :class:`FastCkptSavePlanner`; ``dcp.async_save`` alike) writes a fastckpt checkpoint:
HF-layout safetensors files of FULL tensors (the files a one-process
:func:`fastckpt.save` of the state with every DTensor replaced by its ``full_tensor()`` writes),
each rank writing the chunks DCP's planner gives it at their offsets, committed by one rename.
DCP decides where chunks go; fastckpt moves the bytes with the engine of :func:`fastckpt.save` (:mod:`fastckpt.saving.pages`: the
saver's staging pool, file writer, checksums, manifest builder and commit).

DCP's call order (``torch.distributed.checkpoint.state_dict_saver``), and what happens here:

1. every rank: ``planner.set_up_planner`` (collect: skeleton, file plan, key paths; DTensors
   stand in by global shape) -> ``writer.set_up_storage_writer`` -> ``planner.create_local_plan``
   (DCP's, on ``{key path: tensor or DTensor}``) -> ``writer.prepare_local_plan``.
   With another planner (DCP's ``DefaultSavePlanner`` or a subclass) the fqns are DCP's flattened
   names and ``planner_data`` maps each to its path in the state (DCP's ``flatten_state_dict``):
   the writer rebuilds the state's nesting from those paths, tensors by global shape and dtype,
   so the folder is the one :class:`FastCkptSavePlanner` writes for the same state;
2. coordinator: ``planner.create_global_plan`` (DCP's dedup of replicated chunks) ->
   ``writer.prepare_global_plan``: checks every rank planned the same state, creates the hidden
   folder and every file (headers written), hands each rank the folder, the store session and
   the list of all chunks with their writer;
3. every rank: ``writer.write_data``: :class:`~fastckpt.saving.pages.PageJob`; rank 0 then
   waits for every rank's outcome (store) and removes the folder if any failed. A non-tensor value
   (a BYTE_IO item, which DCP's default planner would ``torch.save``, i.e. pickle) is taken from the
   planner (``lookup_object``) and stored as JSON in ``state.json`` (``fastckpt.format.tree``:
   ``None``, bool, int, float, str, bytes, lists, tuples, dicts, ``torch.dtype``...); any other
   object is refused (:class:`~fastckpt.errors.UnsupportedValueError` naming the key), nothing committed;
4. coordinator: ``writer.finish``: side files, ``manifest.json`` (per-chunk checksums: format
   version 2), one rename. DCP's pickled ``.metadata`` is never written: the manifest is the
   metadata, plus, for plans of DCP's own planners, ``dcp_metadata.json`` (DCP's ``Metadata`` as
   JSON: fqns, tensor properties and chunks, ``planner_data``, ``storage_meta``), which
   :class:`~fastckpt.loading.dcp_reader.FastCkptReader` checks its rebuilt metadata against.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..coordination import Coordinator, group_timeout_s
from ..errors import UnsupportedPlannerError, UnsupportedValueError
from ..format.dtypes import dtype_to_str
from ..format.layout import plan_save
from ..format.tree import flatten, join, unflatten
from ..storage.memory import host_buffer, needs_pinned, pinned_buffer
from ..device import to_host
from ..storage.staging import StagingPool
from .pages import Chunk, PageJob, check_tiling, create_files, run_job
from .collect import Collected, collect
from .dtensor import check_state, placement_of, view_key, walk_state, with_stand_ins
from .committer import check_target, commit_folder, create_folder, dist_section, fmt, remove_uncommitted, write_metadata
from .options import SaveOptions
from .ranks import spec_list, specs_from_list

_KEY = "fastckpt"
_ALIGN = 64
#: DCP's ``Metadata`` as JSON, written beside the manifest for plans of DCP's own planners (docs/FORMAT.md).
DCP_METADATA = "dcp_metadata.json"


def _planner_name() -> str:
    return "fastckpt.dcp.FastCkptSavePlanner"


class FastCkptSavePlanner(DefaultSavePlanner):
    """DCP save planner for :class:`FastCkptWriter`: DCP's :class:`DefaultSavePlanner` on the state's
    arrays only, keyed by fastckpt key paths; non-tensor values stay in the JSON skeleton (``state.json``),
    never pickled.

    Args:
        weights: as :class:`fastckpt.SaveOptions` (default ``{"model": "model"}``): top-level key ->
            HF file stem of the tensors directly under it.

    Raises (from ``set_up_planner``, before any file exists):
        UnsupportedValueError / UnsupportedDtypeError: a value fastckpt cannot store (names the key path).
    """

    def __init__(self, weights: dict[str, str] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights = weights if weights is not None else {"model": "model"}
        self.collected: Collected | None = None
        self.arrays: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """Collect ``state_dict`` (any nesting fastckpt saves) and set DCP's planner up on its arrays."""
        check_state(state_dict)
        sub, dts = with_stand_ins(state_dict)
        col = collect(sub, self.weights)
        self.collected = col
        self.arrays = {s.key: dts[s.key] if s.key in dts else col.sources[s.key] for s in col.specs}  # NumPy: its tensor
        super().set_up_planner(self.arrays, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, carrying what the writer needs to lay out the files (the coordinator's in full)."""
        plan = super().create_local_plan()
        col = self.collected
        info = {"skeleton": col.skeleton, "specs": spec_list(col.specs), "entries": col.entries,
                "placement": {k: placement_of(v) for k, v in self.arrays.items() if hasattr(v, "placements")}}
        data = {"digest": hashlib.sha256(json.dumps([info["skeleton"], info["specs"]], sort_keys=True).encode()).hexdigest(),
                "info": info if self.is_coordinator else None, "weights": self.weights}
        return SavePlan(plan.items, storage_data=plan.storage_data, planner_data={_KEY: data})

    def resolve_data(self, write_item: Any) -> Any:
        """The local tensor of ``write_item`` (a DTensor's local shard; never pickled bytes)."""
        v = self.arrays[write_item.index.fqn]
        return v.to_local() if hasattr(v, "to_local") else v


class FastCkptWriter(StorageWriter):
    """DCP ``StorageWriter`` writing a fastckpt checkpoint folder at ``path`` (see the module docstring).

    Works with DCP's default planner (``dcp.save(state, storage_writer=FastCkptWriter(path))``),
    planners that subclass ``DefaultSavePlanner`` (as torchtitan and transformers use), and
    :class:`FastCkptSavePlanner`; with ``dcp.save`` and ``dcp.async_save``, in one process or on
    every rank of a group. The folder is the same for all: HF-layout safetensors of full tensors
    (top-level keys of ``weights``, default ``{"model": "model"}``, give the HF file stems),
    ``state.json``, ``manifest.json``; non-tensor values are stored as JSON, never pickled.

    Args:
        path: the checkpoint folder to commit (must not exist unless ``overwrite=True``).
        pool: staging memory to reuse (default: the writer's own).
        options: a ready :class:`fastckpt.SaveOptions` instead of ``**kwargs``.
        **kwargs: :class:`fastckpt.SaveOptions` (``overwrite``, ``weights`` (used with DCP's planners;
            :class:`FastCkptSavePlanner` has its own), ``o_direct``, ``io_backend``, ``threads``,
            ``chunk_bytes``, ``max_shard_bytes``, ``metadata``, ``step``, ``extra_files``,
            ``timeout_s``, ``on_commit``).

    Raises (through DCP, which wraps them in its ``CheckpointException``):
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false (before any file exists).
        UnsupportedValueError: a non-tensor value that JSON cannot hold (DCP would pickle it), naming
            its fqn and type; nothing is committed.
        UnsupportedPlannerError: a plan this writer cannot lay out (DCP's plan caching
            ``enable_plan_caching=True``, a planner without ``lookup_object`` for non-tensor values,
            or ``planner_data`` of :class:`FastCkptSavePlanner` with another planner's ``write_data``).
        OSError: a rank's write failed; nothing is committed.
    """

    def __init__(self, path: str | os.PathLike, *, pool: StagingPool | None = None,
                 options: SaveOptions | None = None, **kwargs: Any) -> None:
        self.opts = options if options is not None else SaveOptions(**kwargs)
        self.opts.check()
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.pool = pool if pool is not None else StagingPool()
        self.is_coordinator, self.rank = False, 0
        self.folder: str | None = None
        self.committed = False
        self.save_id = uuid.uuid4().hex

    def __getstate__(self) -> dict:
        """Pickled without its staging pool (locks, pinned memory): DCP's
        ``async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` sends the writer to its
        checkpoint process, which stages into a pool of its own."""
        state = dict(self.__dict__)
        state.pop("pool", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pool = StagingPool()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save: ``checkpoint_id`` (a folder path) replaces ``path`` when given."""
        if checkpoint_id is not None:
            self.path = Path(os.path.abspath(os.fspath(checkpoint_id)))
        self.folder, self.committed = None, False
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a path (str or ``os.PathLike``)."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        """Record this rank's role (DCP passes ``rank`` and ``use_collectives``)."""
        self.is_coordinator, self.rank = is_coordinator, rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse what cannot be laid out (nothing written yet): DCP's plan caching; BYTE_IO items in a
        :class:`FastCkptSavePlanner` plan (it never makes them)."""
        if not getattr(plan, "usable", True):
            raise UnsupportedPlannerError(
                f"{self.path}: rank {self.rank}: DCP sent a cached (empty) plan (enable_plan_caching=True); "
                "FastCkptWriter lays the files out from every rank's full plan: create the planner with "
                "enable_plan_caching=False. Nothing was written")
        if _ours(plan):
            byte_io = [it.index.fqn for it in plan.items if it.type == WriteItemType.BYTE_IO]
            if byte_io:
                raise UnsupportedPlannerError(f"{self.path}: rank {self.rank}: BYTE_IO items {byte_io[:5]} in a "
                                              f"{_planner_name()} plan. Nothing was written")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check the ranks agree, create the folder and files, tell each rank its part."""
        if all(_ours(p) for p in plans):
            datas = [p.planner_data[_KEY] for p in plans]
            bad = [r for r, d in enumerate(datas) if d["digest"] != datas[0]["digest"]]
            if bad:
                raise ValueError(f"{self.path}: ranks {bad} planned a state whose keys, dtypes or shapes differ "
                                 "from rank 0's; every rank must save the same state (DTensors by global shape)")
            info = next(d["info"] for d in datas if d["info"] is not None)
            keys = None
        else:
            info = _dcp_plan_info(plans, self.opts.stems)
            keys = info["keys"]
        chunks = [Chunk(keys[it.index.fqn] if keys else it.index.fqn, tuple(it.tensor_data.chunk.offsets),
                        tuple(it.tensor_data.chunk.sizes), r)
                  for r, p in enumerate(plans) for it in p.items if it.tensor_data is not None]
        chunks = [c for c in chunks if c.numel or not c.shape]
        plan = self._plan(info["specs"], len(plans))
        check_tiling(plan, chunks)
        check_target(self.path, self.opts.overwrite)  # a checkpoint or an empty folder only, never other files
        self.info, self.plan = info, plan
        self.folder = create_folder(self.path, self.opts, plan.file_bytes)
        create_files(plan, self.folder, self.opts)  # every file preallocated, its header written once, here
        shared = {"folder": self.folder, "session": uuid.uuid4().hex, "world": len(plans),
                  "chunks": [[c.key, list(c.offsets), list(c.shape), c.rank] for c in chunks],
                  "header_bytes": sum(len(f.prefix) for f in plan.files)}
        if keys is not None:  # DCP's planner: the other ranks have no collected state
            shared.update(keys=keys, specs=info["specs"])
        return [SavePlan(p.items, storage_data=shared, planner_data=p.planner_data, usable=p.usable) for p in plans]

    def _plan(self, specs: list, world: int) -> Any:
        io = self.opts.io
        return plan_save(specs_from_list(specs), max_shard_bytes=io.max_shard_bytes, chunk_bytes=io.chunk_bytes,
                         metadata=self.opts.metadata, writers=world)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's chunks (:mod:`fastckpt.saving.pages`); the coordinator then waits for every
        rank and removes the folder if one failed. Returns a completed future of ``WriteResult`` s."""
        sd = plan.storage_data
        keys: dict[str, str] | None = sd.get("keys")
        if keys is None and not isinstance(planner, FastCkptSavePlanner):
            raise UnsupportedPlannerError(f"{self.path}: a plan made by {_planner_name()} written with another "
                                          f"planner ({type(planner).__name__}); pass the same planner throughout")
        self.folder = sd["folder"]
        full = self.plan if self.is_coordinator else self._plan(  # the coordinator planned it already
            sd["specs"] if keys is not None else spec_list(planner.collected.specs), sd["world"])
        chunks = [Chunk(k, tuple(o), tuple(s), r) for k, o, s, r in sd["chunks"]]
        store = Coordinator.for_group(None).store
        coord = Coordinator(self.rank, sd["world"], store, "dcp-" + sd["session"],
                            os.environ.get("FASTCKPT_NODE") or socket.gethostname())
        timeout = self.opts.timeout_s if self.opts.timeout_s is not None else group_timeout_s(None)
        sess = coord.session("save", timeout)
        job = PageJob(full, chunks, self.rank, self.folder, self.opts, self.pool, sess)
        results: list[WriteResult] = []
        err: BaseException | None = None
        try:
            if keys is None:
                sources = {chunks[ci].key: planner.resolve_data(_Item(chunks[ci].key)) for ci in job.lay.chunks}
            else:  # DCP's planner: its own write items (a DTensor's local shard), JSON values first
                results += _json_results(plan, planner, self.path, sess)
                mine = {chunks[ci].key for ci in job.lay.chunks}
                sources = {keys[it.index.fqn]: planner.resolve_data(it) for it in plan.items
                           if it.tensor_data is not None and keys[it.index.fqn] in mine}
            hashes = run_job(job, sources)
            nbytes = job.bytes_written + (sd["header_bytes"] if self.is_coordinator else 0)
            files = sorted({full.files[fi].name for fi, _, _, _ in job.lay.spans})
            for it in plan.items:
                if it.tensor_data is None:
                    continue
                off, size = tuple(it.tensor_data.chunk.offsets), tuple(it.tensor_data.chunk.sizes)
                key = keys[it.index.fqn] if keys is not None else it.index.fqn
                ci = next((i for i in job.lay.chunks if chunks[i].key == key and chunks[i].offsets == off
                           and chunks[i].shape == size), None)
                results.append(WriteResult(index=it.index, size_in_bytes=int(torch.Size(size).numel()),
                                           storage_data={"key": key, "offsets": list(off), "shape": list(size),
                                                         "xxh3": hashes.get(ci), "rank": self.rank}))
            rank_info = {"rank": self.rank, "bytes": nbytes, "files": files}
            results.append(WriteResult(index=MetadataIndex("@fastckpt/rank"), size_in_bytes=nbytes, storage_data={"rank_info": rank_info}))
        except BaseException as e:
            err = e
        try:
            sess.publish(f"done/{self.rank}", {"ok": err is None, "error": err and fmt(err)})
            if self.is_coordinator:  # nothing of a failed save may stay behind, whoever calls DCP
                got, missing = sess.wait_until([f"done/{r}" for r in range(sd["world"])],
                                               lambda g: any(not v["ok"] for v in g.values()))
                failed = {k: v["error"] for k, v in got.items() if not v["ok"]}
                if failed or missing:
                    remove_uncommitted(self.folder, self.opts)
                    if err is None:
                        err = RuntimeError(f"{self.path}: not committed: {failed or {m: 'no report' for m in missing}}")
        finally:
            sess.close()
        if err is not None:
            raise err
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: side files, ``manifest.json`` last, the rename (no pickled ``.metadata``)."""
        try:
            self._finish(results, metadata)
        except BaseException:
            remove_uncommitted(self.folder, self.opts)
            raise

    def _finish(self, results: list[list[WriteResult]], metadata: Metadata) -> None:
        """Every rank's results as the saver's rank reports, then the saver's manifest builder and commit."""
        plan, info, opts = self.plan, self.info, self.opts
        shapes = {t.spec.key: list(t.spec.shape) for f in plan.files for t in f.tensors}
        reports: dict[int, dict] = {}
        values: dict[str, Any] = {}
        for r, rank_results in enumerate(results):
            rep = reports.setdefault(r, {"hashes": {}, "chunks": {}, "files": {}, "entries": {},
                                         "bytes": 0, "written": [], "placement": info.get("placement", {})})
            for res in rank_results:
                d = res.storage_data
                if "rank_info" in d:
                    rep["bytes"], rep["written"] = d["rank_info"]["bytes"], d["rank_info"]["files"]
                elif "value" in d:
                    values[res.index.fqn] = unflatten(d["value"], _no_array)
                elif d["xxh3"] is None:
                    continue
                elif d["shape"] == shapes[d["key"]]:
                    rep["hashes"][d["key"]] = d["xxh3"]
                else:
                    rep["chunks"].setdefault(d["key"], []).append(
                        {"offsets": d["offsets"], "shape": d["shape"], "xxh3": d["xxh3"]})
        skeleton, extra = info["skeleton"], None
        if "keys" in info:  # DCP's planner: the JSON values into the skeleton, DCP's metadata beside it
            skeleton = flatten(_dcp_tree(info, values), lambda k, v: None)
            extra = {DCP_METADATA: _dcp_metadata_json(metadata, info, self.storage_meta())}
        node = os.environ.get("FASTCKPT_NODE") or socket.gethostname()
        dist = dist_section(plan, {}, reports, mode="rename", node=node, nodes=[node], local_keys=opts.local_keys,
                            planner="dcp")
        write_metadata(self.folder, plan, None, skeleton, info["entries"], opts, reports, world=len(results),
                       dist=dist, extra=extra)
        commit_folder(self.folder, self.path, opts)
        self.committed = True

    def storage_meta(self) -> StorageMeta:
        """DCP's ``StorageMeta`` of this save (``checkpoint_id``: the folder; ``save_id``: new per save),
        as DCP's ``FileSystemWriter`` gives it; recorded in ``dcp_metadata.json``."""
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)


class FastCkptStager(AsyncStager):
    """DCP ``AsyncStager``: snapshots a state at the call into one reused host buffer.

    ``stage(state)`` returns the same nesting with every tensor copied into the buffer and
    every DTensor rebuilt on its copied local shard (same mesh, placements, global shape); other
    values are shared. The same view under two key paths (tied weights) stays one copy;
    different views of one storage are copied apart. The buffer grows as needed and is reused
    by the next ``stage``: start the next save only after the previous one finished
    (``dcp.async_save(...).result()``; fastckpt's own saves do).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def stage(self, state_dict: Any) -> Any:
        """A snapshot of ``state_dict`` (see the class docstring); blocks until copied."""
        from torch.distributed.tensor import DTensor
        leaves: list[torch.Tensor] = []
        seen: dict[int, int] = {}

        def local(v: torch.Tensor) -> torch.Tensor:
            return v.to_local() if isinstance(v, DTensor) else v

        def ident(v: torch.Tensor) -> Any:
            return id(v) if isinstance(v, DTensor) else view_key(v)

        def find(_: str, v: Any) -> None:
            if isinstance(v, torch.Tensor) and ident(v) not in seen:
                seen[ident(v)] = len(leaves)
                leaves.append(v)
        walk_state(state_dict, "", find)
        offs, total = [], 0
        for v in leaves:
            t = local(v)
            offs.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pin = needs_pinned(local(v) for v in leaves)
        if self._buf is None or self._buf.numel() < total or (pin and not self._buf.is_pinned()):
            # page-locked for CUDA tensors (device -> host copies at full speed), ordinary pages for CPU ones
            buf = pinned_buffer(max(total, 1)) if pin else None
            self._buf = (buf or host_buffer(max(total, 1)))[0]
        copies: list[torch.Tensor] = []
        for v, off in zip(leaves, offs):
            t = local(v)
            n = t.numel() * t.element_size()
            dst = self._buf[off:off + n]
            to_host(dst, t).wait()  # explicit completion before anything reads the buffer
            c = dst.view(t.dtype).view(t.shape) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
            if isinstance(v, DTensor):
                c = _host_dtensor(c, v)
            copies.append(c)

        def rebuild(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return copies[seen[ident(v)]]
            if isinstance(v, dict):
                return {k: rebuild(x) for k, x in v.items()}
            if isinstance(v, list):
                return [rebuild(x) for x in v]
            if isinstance(v, tuple):
                return tuple(rebuild(x) for x in v)
            return v
        return rebuild(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: :meth:`stage` blocks until the copy is done."""

    def close(self) -> None:
        """Drop the buffer."""
        self._buf = None


def _host_dtensor(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh, placements and global shape on the host tensor ``local``
    (``DTensor.from_local`` would move it back to the mesh's device, e.g. CUDA)."""
    from torch.distributed.tensor import DTensor
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        spec = DTensorSpec(like.device_mesh, tuple(like.placements),
                           tensor_meta=TensorMeta(like.shape, like.stride(), like.dtype))
        return DTensor(local, spec, requires_grad=False)
    except (ImportError, TypeError):  # torch moved the spec: the public constructor (CPU meshes stay on the host)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())


def _ours(plan: SavePlan) -> bool:
    """True for a plan made by :class:`FastCkptSavePlanner` (its ``planner_data``)."""
    return isinstance(plan.planner_data, dict) and _KEY in plan.planner_data




def _no_array(key: str, v: Any) -> None:
    raise UnsupportedValueError(f"a tensor or array at {key!r} inside a non-tensor value")


def _obj_path(fqn: str, paths: Any) -> tuple:
    """The state path of ``fqn``: DCP's ``planner_data`` mapping (``flatten_state_dict``), else ``(fqn,)``."""
    p = paths.get(fqn) if isinstance(paths, dict) else None
    if isinstance(p, (tuple, list)) and p and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in p):
        return tuple(p)
    return (fqn,)


def _dcp_plan_info(plans: list[SavePlan], stems: dict[str, str]) -> dict:
    """What :meth:`FastCkptWriter.prepare_global_plan` needs from the plans of DCP's own planner
    (``DefaultSavePlanner`` or a subclass): the state's nesting rebuilt from ``planner_data`` (fqn ->
    path), tensors as stand-ins of their global shape and dtype, non-tensor values as ``None`` until
    :meth:`FastCkptWriter.finish` has them; collected as :class:`FastCkptSavePlanner` collects the state.

    Returns:
        ``{"skeleton", "specs", "entries", "placement", "keys": {fqn: key path}, "order": [fqn...],
        "paths": {fqn: [path...]}, "tensors": {fqn: stand-in}}``.
    """
    tensors: dict[str, tuple] = {}
    byte_io: set[str] = set()
    for p in plans:
        for it in p.items:
            if it.type == WriteItemType.BYTE_IO:
                byte_io.add(it.index.fqn)
            elif it.tensor_data is not None:
                tensors.setdefault(it.index.fqn, (tuple(it.tensor_data.size), it.tensor_data.properties.dtype))
    order: list[str] = []
    seen: set[str] = set()
    for p in plans:  # the state's order: DCP's flattening on rank 0 (every fqn), then what only others hold
        names = list(p.planner_data) if isinstance(p.planner_data, dict) else []
        for fqn in names + [it.index.fqn for it in p.items]:
            if fqn not in seen and (fqn in tensors or fqn in byte_io):
                seen.add(fqn)
                order.append(fqn)
    paths = {fqn: next((_obj_path(fqn, p.planner_data) for p in plans
                        if isinstance(p.planner_data, dict) and fqn in p.planner_data), (fqn,)) for fqn in order}
    keys = {}
    for fqn, path in paths.items():
        k = ""
        for e in path:
            k = join(k, e)
        keys[fqn] = k
    stand = {fqn: torch.empty((1,) if len(shape) else (), dtype=dt).expand(shape)
             for fqn, (shape, dt) in tensors.items()}
    info = {"order": order, "paths": {f: list(p) for f, p in paths.items()}, "keys": keys, "tensors": stand,
            "placement": {}}
    col = collect(_dcp_tree(info, {}), stems)
    info.update(skeleton=col.skeleton, specs=spec_list(col.specs), entries=col.entries)
    return info


def _dcp_tree(info: dict, values: dict[str, Any]) -> dict:
    """The saved state's nesting (DCP's ``set_element`` along each fqn's path): stand-ins for
    tensors, ``values`` (fqn -> value) for the rest."""
    root: dict = {}
    for fqn in info["order"]:
        value = info["tensors"][fqn] if fqn in info["tensors"] else values.get(fqn)
        set_element(root, tuple(info["paths"][fqn]), value)
    return root


def _json_results(plan: SavePlan, planner: Any, path: Path, sess: Any) -> list[WriteResult]:
    """``WriteResult`` s holding the JSON form of this rank's non-tensor values; every rank of the save
    learns through the store whether any rank refused one, before any rank writes a byte (a rank left
    writing alone would wait for the refusing one until the timeout).

    Raises:
        UnsupportedValueError / UnsupportedPlannerError: this rank's refusal (see :func:`_json_value`).
        UnsupportedValueError: on the other ranks, naming the rank that refused and its message.
    """
    own: BaseException | None = None
    out: list[WriteResult] = []
    try:
        out = [WriteResult(index=it.index, size_in_bytes=0, storage_data={"value": _json_value(planner, it, path)})
               for it in plan.items if it.type == WriteItemType.BYTE_IO]
    except (UnsupportedValueError, UnsupportedPlannerError) as e:
        own = e
    got = sess.all_gather("json-values", None if own is None else f"{type(own).__name__}: {own}",
                          f"storing the non-tensor values of {path}")
    if own is not None:
        raise own
    failed = {r: t for r, t in enumerate(got) if t is not None}
    if failed:
        lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
        raise UnsupportedValueError(f"{path}: not written: {lines}")
    return out


def _json_value(planner: Any, item: Any, path: Path) -> Any:
    """The JSON form (:func:`fastckpt.format.tree.flatten`) of the non-tensor value of BYTE_IO ``item``,
    taken from ``planner.lookup_object`` (DCP's ``DefaultSavePlanner`` API), never pickled.

    Raises:
        UnsupportedPlannerError: the planner has no ``lookup_object``.
        UnsupportedValueError: the value is not JSON-able (names the fqn and the type).
    """
    fqn = item.index.fqn
    look = getattr(planner, "lookup_object", None)
    if look is None:
        raise UnsupportedPlannerError(
            f"{path}: non-tensor value {fqn!r}: planner {type(planner).__name__} has no lookup_object (DCP's "
            "DefaultSavePlanner API) to take the value from, and its resolve_data gives pickled bytes; subclass "
            "DefaultSavePlanner or pass planner=fastckpt.dcp.FastCkptSavePlanner(). Nothing was committed")
    obj = look(item.index)
    arrays: list[str] = []
    try:
        skeleton = flatten(obj, lambda key, v: arrays.append(f"a {type(v).__name__} at {key!r}"))
    except UnsupportedValueError as e:
        inner = "" if "'<root>'" in str(e) else f" ({e})"  # the value itself: its type is named already
        raise UnsupportedValueError(
            f"{path}: non-tensor value {fqn!r} of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
            f"stored without pickle{inner}. DCP's FileSystemWriter would torch.save (pickle) it; fastckpt stores "
            "non-tensor values as JSON (None, bool, int, float, str, bytes, list, tuple, dict with str/int keys, "
            "torch.dtype, torch.device) so that no load unpickles: convert it to such values or to a tensor "
            "(e.g. its state_dict()), or leave it out of the state. Nothing was committed") from None
    if arrays:
        raise UnsupportedValueError(
            f"{path}: non-tensor value {fqn!r} "
            + (f"is a {type(obj).__name__}" if arrays[0].endswith(" at ''") else f"({type(obj).__name__}) holds {arrays[0]}")
            + ": DCP's default planner takes a NumPy array, or a tuple and anything in it, whole, as one value to "
            "pickle, so its arrays and tensors are not laid out as tensors. Pass "
            "planner=fastckpt.dcp.FastCkptSavePlanner() (it stores them as tensors; FastCkptReader with "
            "planner=fastckpt.dcp.FastCkptLoadPlanner() reads them back), or make a tuple a list. Nothing was committed")
    return skeleton


def _dcp_metadata_json(metadata: Metadata, info: dict, storage_meta: StorageMeta) -> bytes:
    """DCP's ``Metadata`` of the save as JSON (no pickle): per fqn the tensor's dtype, global size,
    ``requires_grad`` and the chunks the ranks wrote, or ``{"type": "bytes"}``; ``planner_data``
    (fqn -> path), ``storage_meta``, and the fastckpt key path of each fqn."""
    md = {}
    for fqn, v in metadata.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            md[fqn] = {"type": "tensor", "dtype": dtype_to_str(v.properties.dtype, tensor=fqn), "size": list(v.size),
                       "requires_grad": bool(v.properties.requires_grad),
                       "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in v.chunks]}
        else:
            md[fqn] = {"type": "bytes"}
    doc = {"format": "fastckpt-dcp-metadata", "version": 1, "dcp_version": metadata.version,
           "state_dict_metadata": md,
           "planner_data": {f: list(_obj_path(f, metadata.planner_data)) for f in metadata.planner_data}
           if isinstance(metadata.planner_data, dict) else None,
           "storage_meta": {"checkpoint_id": str(storage_meta.checkpoint_id), "save_id": storage_meta.save_id,
                            "modules": list(storage_meta.modules)},
           "key_paths": info["keys"]}
    return json.dumps(doc, separators=(",", ":")).encode()


class _Item:
    """The part of a DCP ``WriteItem`` :meth:`FastCkptSavePlanner.resolve_data` reads."""

    def __init__(self, fqn: str):
        self.index = type("Index", (), {"fqn": fqn})()


