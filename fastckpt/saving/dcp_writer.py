"""fastckpt on torch.distributed.checkpoint (DCP): a save planner, a ``StorageWriter``, an ``AsyncStager``.

``dcp.save(state, storage_writer=FastCkptWriter(path))`` (DCP's ``DefaultSavePlanner``, a subclass
of it, or :class:`FastCkptSavePlanner`; ``dcp.async_save`` alike) writes a fastckpt checkpoint:
HF-layout safetensors files of FULL tensors (the files a one-process
:func:`fastckpt.save` of the state with every DTensor replaced by its ``full_tensor()`` writes),
each rank writing the chunks DCP's planner gives it at their offsets, committed by one rename.
DCP decides where chunks go; fastckpt moves the bytes (:mod:`fastckpt.saving.chunk_job`).

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
3. every rank: ``writer.write_data``: :class:`~fastckpt.saving.chunk_job.ChunkJob`; rank 0 then
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..coordination import Coordinator, group_timeout_s
from ..errors import CheckpointExistsError, UnsupportedPlannerError, UnsupportedValueError
from ..format.dtypes import dtype_to_str
from ..format.layout import plan_save
from ..format.tree import flatten, join, unflatten
from ..storage import commit as cm
from ..storage.io import FileWriter, get_backend, memory_backed, write_all
from ..storage.staging import StagingPool
from .chunk_job import ChunkJob, run_job
from .chunks import Chunk, check_tiling
from .collect import Collected, collect
from .committer import commit_folder, create_folder, fmt, remove_uncommitted
from ..format.manifest import Distributed, FileEntry, TensorChunk
from .metadata import manifest_doc, merge_entry, tensor_entries, write_manifest, write_side_files
from .options import SaveOptions
from .ranks import RANK_KEY, local_stem, rank_specs, spec_list, specs_from_list

_KEY = "fastckpt"
#: DCP's ``Metadata`` as JSON, written beside the manifest for plans of DCP's own planners (docs/FORMAT.md).
DCP_METADATA = "dcp_metadata.json"


def _planner_name() -> str:
    return "fastckpt.dcp.FastCkptSavePlanner"


def _placement(p: Any) -> str:
    """``"Shard(1)"`` / ``"Replicate()"``: a placement as the manifest names it."""
    return f"Shard({p.dim})" if hasattr(p, "dim") else f"{type(p).__name__}()"


class FastCkptSavePlanner(DefaultSavePlanner):
    """DCP save planner for :class:`FastCkptWriter`: DCP's :class:`DefaultSavePlanner` on the state's
    arrays only, keyed by fastckpt key paths; non-tensor values stay in the JSON skeleton (``state.json``),
    never pickled.

    Args:
        weights: as :class:`fastckpt.SaveOptions` (default ``{"model": "model"}``): top-level key ->
            HF file stem of the tensors directly under it.
        local: ``(rank, collected)``: this rank's rank-local state (``local_keys`` of a
            :func:`fastckpt.save` of a DTensor state; :func:`fastckpt.saving.collect.collect` of
            ``{"local": {key: subtree}}``), written by this rank alone to ``rank0000r-*.safetensors`` and
            ``state-rank0000r.json`` as a ``process_group=`` save writes it (docs/FORMAT.md, "Multi-rank").

    Raises (from ``set_up_planner``, before any file exists):
        UnsupportedValueError / UnsupportedDtypeError: a value fastckpt cannot store (names the key path).
    """

    def __init__(self, weights: dict[str, str] | None = None, *, local: tuple[int, Collected] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights = weights if weights is not None else {"model": "model"}
        self.local = local
        self.collected: Collected | None = None
        self.arrays: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """Collect ``state_dict`` (any nesting fastckpt saves) and set DCP's planner up on its arrays."""
        from .dtensor import check_state, with_stand_ins
        check_state(state_dict)
        sub, dts = with_stand_ins(state_dict)
        col = collect(sub, self.weights)
        self.collected = col
        self.arrays = {s.key: dts[s.key] if s.key in dts else col.sources[s.key] for s in col.specs}  # NumPy: its tensor
        if self.local is not None:  # rank-local tensors: keys of this rank only, so DCP's dedup keeps them here
            pre = RANK_KEY.format(self.local[0])
            self.arrays.update((pre + k, t) for k, t in self.local[1].sources.items())
        super().set_up_planner(self.arrays, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, carrying what the writer needs to lay out the files (the coordinator's in full)."""
        plan = super().create_local_plan()
        col = self.collected
        info = {"skeleton": col.skeleton, "specs": spec_list(col.specs), "entries": col.entries,
                "placement": {k: {"mesh_shape": list(v.device_mesh.shape), "placements": [_placement(p) for p in v.placements]}
                              for k, v in self.arrays.items() if hasattr(v, "placements")}}
        data = {"digest": hashlib.sha256(json.dumps([info["skeleton"], info["specs"]], sort_keys=True).encode()).hexdigest(),
                "info": info if self.is_coordinator else None, "weights": self.weights, "local": self._local_info()}
        return SavePlan(plan.items, storage_data=plan.storage_data, planner_data={_KEY: data})

    def _local_info(self) -> dict | None:
        """This rank's rank-local specs, entries and skeleton (keys under ``RANK_KEY``), or ``None``."""
        if self.local is None:
            return None
        rank, col = self.local
        pre = RANK_KEY.format(rank)
        entries = {pre + k: {**e, **{ref: pre + e[ref] for ref in ("alias", "view") if ref in e}}
                   for k, e in col.entries.items()}
        return {"rank": rank, "specs": spec_list(rank_specs(col.specs, rank)), "entries": entries,
                "skeleton": col.skeleton if (col.specs or col.entries) else None}

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
        self.local: list[dict] = []  # coordinator: every rank's rank-local info (local_keys)
        self.save_id = uuid.uuid4().hex

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
        self.local = []  # coordinator: every rank's rank-local info (local_keys; fastckpt's planner only)
        if all(_ours(p) for p in plans):
            datas = [p.planner_data[_KEY] for p in plans]
            bad = [r for r, d in enumerate(datas) if d["digest"] != datas[0]["digest"]]
            if bad:
                raise ValueError(f"{self.path}: ranks {bad} planned a state whose keys, dtypes or shapes differ "
                                 "from rank 0's; every rank must save the same state (DTensors by global shape)")
            info = next(d["info"] for d in datas if d["info"] is not None)
            self.local = [d["local"] for d in datas if d.get("local")]
            keys = None
        else:
            info = _dcp_plan_info(plans, self.opts.stems)
            keys = info["keys"]
        local_specs = [row for loc in self.local for row in loc["specs"]]
        chunks = [Chunk(keys[it.index.fqn] if keys else it.index.fqn, tuple(it.tensor_data.chunk.offsets),
                        tuple(it.tensor_data.chunk.sizes), r)
                  for r, p in enumerate(plans) for it in p.items if it.tensor_data is not None]
        chunks = [c for c in chunks if c.numel or not c.shape]
        plan = self._plan(info["specs"] + local_specs)
        check_tiling(plan, chunks)
        if self.path.exists() and not self.opts.overwrite:
            raise CheckpointExistsError(f"{self.path} already exists; pass overwrite=True to replace it atomically")
        self.info, self.plan = info, plan
        self.folder = create_folder(self.path, self.opts, plan.file_bytes)
        be = get_backend(self.opts.io.io_backend)
        # every file created and preallocated (only sized on tmpfs & co.), its header written once, by this rank
        prealloc = not memory_backed(self.folder)
        for f in plan.files:
            w = FileWriter(be, os.path.join(self.folder, f.name), f.size, False, create=True, preallocate=prealloc)
            try:
                write_all(be, w.fd, memoryview(f.prefix), 0)
                w.sync()
            finally:
                w.close()
        shared = {"folder": self.folder, "session": uuid.uuid4().hex, "world": len(plans),
                  "chunks": [[c.key, list(c.offsets), list(c.shape), c.rank] for c in chunks],
                  "header_bytes": sum(len(f.prefix) for f in plan.files), "local_specs": local_specs}
        if keys is not None:  # DCP's planner: the other ranks have no collected state
            shared.update(keys=keys, specs=info["specs"])
        return [SavePlan(p.items, storage_data=shared, planner_data=p.planner_data, usable=p.usable) for p in plans]

    def _plan(self, specs: list) -> Any:
        io = self.opts.io
        return plan_save(specs_from_list(specs), max_shard_bytes=io.max_shard_bytes, chunk_bytes=io.chunk_bytes,
                         metadata=self.opts.metadata)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's chunks (:mod:`fastckpt.saving.chunk_job`); the coordinator then waits for every
        rank and removes the folder if one failed. Returns a completed future of ``WriteResult`` s."""
        sd = plan.storage_data
        keys: dict[str, str] | None = sd.get("keys")
        if keys is None and not isinstance(planner, FastCkptSavePlanner):
            raise UnsupportedPlannerError(f"{self.path}: a plan made by {_planner_name()} written with another "
                                          f"planner ({type(planner).__name__}); pass the same planner throughout")
        self.folder = sd["folder"]
        full = self._plan((sd["specs"] if keys is not None else spec_list(planner.collected.specs))
                          + sd.get("local_specs", []))
        chunks = [Chunk(k, tuple(o), tuple(s), r) for k, o, s, r in sd["chunks"]]
        store = Coordinator.for_group(None).store
        coord = Coordinator(self.rank, sd["world"], store, "dcp-" + sd["session"],
                            os.environ.get("FASTCKPT_NODE") or socket.gethostname())
        timeout = self.opts.timeout_s if self.opts.timeout_s is not None else group_timeout_s(None)
        sess = coord.session("save", timeout)
        job = ChunkJob(full, chunks, self.rank, self.folder, self.opts, self.pool, sess)
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
            side = _write_local_skeleton(self.folder, planner._local_info() if keys is None else None)
            rank_info = {"rank": self.rank, "bytes": nbytes + sum(f["bytes"] for f in side.values()),
                         "files": files + sorted(side), "side": side}
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
        plan, info, opts = self.plan, self.info, self.opts
        single: dict[str, str] = {}
        multi: dict[str, list[dict]] = {}
        ranks: dict[int, dict] = {}
        values: dict[str, Any] = {}
        for rank_results in results:
            for res in rank_results:
                d = res.storage_data
                if "rank_info" in d:
                    ranks[d["rank_info"]["rank"]] = d["rank_info"]
                elif "value" in d:
                    values[res.index.fqn] = unflatten(d["value"], _no_array)
                elif d["xxh3"] is not None:
                    multi.setdefault(d["key"], []).append({"offsets": d["offsets"], "shape": d["shape"], "xxh3": d["xxh3"]})
        shapes = {t.spec.key: list(t.spec.shape) for f in plan.files for t in f.tensors}
        for k in list(multi):
            if len(multi[k]) == 1 and multi[k][0]["shape"] == shapes[k]:
                single[k] = multi.pop(k)[0]["xxh3"]
        stems = {local_stem(loc["rank"]) for loc in self.local}  # rank-local files get no HF index, as in ranks.py
        skeleton, extra = info["skeleton"], opts.extra_files
        if "keys" in info:  # DCP's planner: the JSON values into the skeleton, DCP's metadata beside it
            skeleton = flatten(_dcp_tree(info, values), lambda k, v: None)
            extra = {**(extra or {}), DCP_METADATA: _dcp_metadata_json(metadata, info, self.storage_meta())}
        files = write_side_files(self.folder, replace(plan, index={k: v for k, v in plan.index.items() if k not in stems}),
                                 skeleton, extra)
        for r in sorted(ranks):
            files.update({n: FileEntry(**d) for n, d in ranks[r].get("side", {}).items()})  # rank-local skeletons
        tensors = tensor_entries(plan, single, info["entries"])
        for loc in self.local:
            for k, e in loc["entries"].items():
                tensors[k] = merge_entry(tensors.get(k), e)
        for k, cs in multi.items():  # the manifest's version follows from the chunks (format 2)
            tensors[k].xxh3 = None
            tensors[k].chunks = [TensorChunk(tuple(c["offsets"]), tuple(c["shape"]), c["xxh3"])
                                 for c in sorted(cs, key=lambda c: c["offsets"])]
            if k in info.get("placement", {}):  # informational (docs/FORMAT.md, "Version 2")
                tensors[k].placement = info["placement"][k]
        written_by: dict[str, list[int]] = {}
        for r in sorted(ranks):
            for name in ranks[r]["files"]:
                written_by.setdefault(name, []).append(r)
        section = Distributed(
            mode="rename", node=None, nodes=[os.environ.get("FASTCKPT_NODE") or socket.gethostname()],
            written_by=written_by, bytes_by_rank={r: ranks[r]["bytes"] for r in sorted(ranks)},
            rank_local_keys=list(opts.local_keys),
            rank_local_skeletons={r: n for r in sorted(ranks) for n in ranks[r].get("side", {})},
            planner="dcp")
        manifest = manifest_doc(opts, files, tensors, world_size=len(results), distributed=section)
        write_manifest(self.folder, manifest)
        commit_folder(self.folder, self.path, opts)
        self.committed = True

    def storage_meta(self) -> StorageMeta:
        """DCP's ``StorageMeta`` of this save (``checkpoint_id``: the folder; ``save_id``: new per save),
        as DCP's ``FileSystemWriter`` gives it; recorded in ``dcp_metadata.json``."""
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)


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
    try:
        return flatten(obj, _no_array)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(
            f"{path}: non-tensor value {fqn!r} of type {type(obj).__module__}.{type(obj).__qualname__} cannot be "
            f"stored without pickle ({e}). DCP's FileSystemWriter would torch.save (pickle) it; fastckpt stores "
            "non-tensor values as JSON (None, bool, int, float, str, bytes, list, tuple, dict with str/int keys, "
            "torch.dtype, torch.device) so that no load unpickles: convert it to such values or to a tensor "
            "(e.g. its state_dict()), or leave it out of the state. Nothing was committed") from None


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


def _write_local_skeleton(folder: str, local: dict | None) -> dict[str, dict]:
    """Write rank ``local["rank"]``'s ``state-rank0000r.json`` (rank-local skeleton); returns
    ``{file name: {"bytes", "xxh3"}}`` (empty without rank-local state)."""
    if local is None or local["skeleton"] is None:
        return {}
    name = f"state-rank{local['rank']:05d}.json"
    data = json.dumps(local["skeleton"], separators=(",", ":")).encode()
    cm.write_small_file(os.path.join(folder, name), data)
    return {name: {"bytes": len(data), "xxh3": xxhash.xxh3_64(data).hexdigest()}}


def read_manifest_bytes(path: Path) -> dict:
    """``bytes_total`` and ``bytes_by_rank`` of a committed checkpoint (every rank reads them after the commit)."""
    m = cm.read_manifest(path)
    return {"bytes_total": m.bytes_total or 0,
            "bytes_by_rank": dict(m.distributed.bytes_by_rank) if m.distributed is not None else {}}
