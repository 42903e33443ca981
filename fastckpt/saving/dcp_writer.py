"""fastckpt on torch.distributed.checkpoint (DCP): a save planner, a ``StorageWriter``, an ``AsyncStager``.

``dcp.save(state, storage_writer=FastCkptWriter(path), planner=FastCkptSavePlanner())`` writes a
fastckpt checkpoint: HF-layout safetensors files of FULL tensors (the files a one-process
:func:`fastckpt.save` of the state with every DTensor replaced by its ``full_tensor()`` writes),
each rank writing the chunks DCP's planner gives it at their offsets, committed by one rename.
DCP decides where chunks go; fastckpt moves the bytes (:mod:`fastckpt.saving.chunk_job`).

DCP's call order (``torch.distributed.checkpoint.state_dict_saver``), and what happens here:

1. every rank: ``planner.set_up_planner`` (collect: skeleton, file plan, key paths; DTensors
   stand in by global shape) -> ``writer.set_up_storage_writer`` -> ``planner.create_local_plan``
   (DCP's, on ``{key path: tensor or DTensor}``) -> ``writer.prepare_local_plan`` (refuses
   BYTE_IO items: DCP's default planners ``torch.save`` them);
2. coordinator: ``planner.create_global_plan`` (DCP's dedup of replicated chunks) ->
   ``writer.prepare_global_plan``: checks every rank planned the same state, creates the hidden
   folder and every file (headers written), hands each rank the folder, the store session and
   the list of all chunks with their writer;
3. every rank: ``writer.write_data``: :class:`~fastckpt.saving.chunk_job.ChunkJob`; rank 0 then
   waits for every rank's outcome (store) and removes the folder if any failed;
4. coordinator: ``writer.finish``: side files, ``manifest.json`` (per-chunk checksums: format
   version 2), one rename. DCP's pickled ``.metadata`` is never written: the manifest is the metadata.
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
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..coordination import Coordinator, group_timeout_s
from ..errors import CheckpointExistsError, UnsupportedPlannerError
from ..format.layout import plan_save
from ..storage import commit as cm
from ..storage.io import FileWriter, get_backend, memory_backed, write_all
from ..storage.staging import StagingPool
from .chunk_job import ChunkJob, run_job
from .chunks import Chunk, check_tiling
from .collect import Collected, collect
from .committer import commit_folder, create_folder, fmt, remove_uncommitted
from .metadata import manifest_doc, tensor_entries, write_manifest, write_side_files
from .options import SaveOptions
from .ranks import RANK_KEY, local_stem, rank_specs, spec_list, specs_from_list

_KEY = "fastckpt"


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

    Use with :class:`FastCkptSavePlanner`; a plan from another planner is refused
    (:class:`~fastckpt.errors.UnsupportedPlannerError`, before any file exists).

    Args:
        path: the checkpoint folder to commit (must not exist unless ``overwrite=True``).
        pool: staging memory to reuse (default: the writer's own).
        options: a ready :class:`fastckpt.SaveOptions` instead of ``**kwargs``.
        **kwargs: :class:`fastckpt.SaveOptions` (``overwrite``, ``o_direct``, ``io_backend``,
            ``threads``, ``chunk_bytes``, ``max_shard_bytes``, ``metadata``, ``step``,
            ``extra_files``, ``timeout_s``, ``on_commit``). ``weights`` belongs to the planner.

    Raises (through DCP, which wraps them in its ``CheckpointException``):
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false (before any file exists).
        UnsupportedPlannerError: BYTE_IO items or a plan not made by :class:`FastCkptSavePlanner`.
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

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save: ``checkpoint_id`` (a folder path) replaces ``path`` when given."""
        if checkpoint_id is not None:
            self.path = Path(os.path.abspath(os.fspath(checkpoint_id)))
        self.folder, self.committed = None, False

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a path (str or ``os.PathLike``)."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        """Record this rank's role (DCP passes ``rank`` and ``use_collectives``)."""
        self.is_coordinator, self.rank = is_coordinator, rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse BYTE_IO items and plans without :class:`FastCkptSavePlanner`'s data (nothing written yet)."""
        byte_io = [it.index.fqn for it in plan.items if it.type == WriteItemType.BYTE_IO]
        if byte_io:
            raise UnsupportedPlannerError(
                f"{self.path}: rank {self.rank}: DCP's planner made BYTE_IO items for {byte_io[:5]} (non-tensor values "
                f"it would torch.save, i.e. pickle); pass planner={_planner_name()}() so that they are stored as "
                "JSON. Nothing was written")
        if not isinstance(plan.planner_data, dict) or _KEY not in plan.planner_data:
            raise UnsupportedPlannerError(
                f"{self.path}: rank {self.rank}: this plan was not made by {_planner_name()}; pass "
                f"planner={_planner_name()}() to torch.distributed.checkpoint.save. Nothing was written")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check the ranks agree, create the folder and files, tell each rank its part."""
        datas = [p.planner_data[_KEY] for p in plans]
        bad = [r for r, d in enumerate(datas) if d["digest"] != datas[0]["digest"]]
        if bad:
            raise ValueError(f"{self.path}: ranks {bad} planned a state whose keys, dtypes or shapes differ from "
                             "rank 0's; every rank must save the same state (DTensors by global shape)")
        info = next(d["info"] for d in datas if d["info"] is not None)
        self.local = [d["local"] for d in datas if d.get("local")]  # rank-local states (local_keys)
        local_specs = [row for loc in self.local for row in loc["specs"]]
        chunks = [Chunk(it.index.fqn, tuple(it.tensor_data.chunk.offsets), tuple(it.tensor_data.chunk.sizes), r)
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
        return [SavePlan(p.items, storage_data=shared, planner_data=p.planner_data) for p in plans]

    def _plan(self, specs: list) -> Any:
        io = self.opts.io
        return plan_save(specs_from_list(specs), max_shard_bytes=io.max_shard_bytes, chunk_bytes=io.chunk_bytes,
                         metadata=self.opts.metadata)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's chunks (:mod:`fastckpt.saving.chunk_job`); the coordinator then waits for every
        rank and removes the folder if one failed. Returns a completed future of ``WriteResult`` s."""
        sd = plan.storage_data
        if not isinstance(planner, FastCkptSavePlanner):
            raise UnsupportedPlannerError(f"{self.path}: pass planner={_planner_name()}()")
        self.folder = sd["folder"]
        col = planner.collected
        full = self._plan(spec_list(col.specs) + sd.get("local_specs", []))
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
            sources = {chunks[ci].key: planner.resolve_data(_Item(chunks[ci].key)) for ci in job.lay.chunks}
            hashes = run_job(job, sources)
            nbytes = job.bytes_written + (sd["header_bytes"] if self.is_coordinator else 0)
            files = sorted({full.files[fi].name for fi, _, _, _ in job.lay.spans})
            for it in plan.items:
                if it.tensor_data is None:
                    continue
                off, size = tuple(it.tensor_data.chunk.offsets), tuple(it.tensor_data.chunk.sizes)
                ci = next((i for i in job.lay.chunks if chunks[i].key == it.index.fqn and chunks[i].offsets == off
                           and chunks[i].shape == size), None)
                results.append(WriteResult(index=it.index, size_in_bytes=int(torch.Size(size).numel()),
                                           storage_data={"key": it.index.fqn, "offsets": list(off), "shape": list(size),
                                                         "xxh3": hashes.get(ci), "rank": self.rank}))
            side = _write_local_skeleton(self.folder, planner._local_info())
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
            self._finish(results)
        except BaseException:
            remove_uncommitted(self.folder, self.opts)
            raise

    def _finish(self, results: list[list[WriteResult]]) -> None:
        plan, info, opts = self.plan, self.info, self.opts
        single: dict[str, str] = {}
        multi: dict[str, list[dict]] = {}
        ranks: dict[int, dict] = {}
        for rank_results in results:
            for res in rank_results:
                d = res.storage_data
                if "rank_info" in d:
                    ranks[d["rank_info"]["rank"]] = d["rank_info"]
                elif d["xxh3"] is not None:
                    multi.setdefault(d["key"], []).append({"offsets": d["offsets"], "shape": d["shape"], "xxh3": d["xxh3"]})
        shapes = {t.spec.key: list(t.spec.shape) for f in plan.files for t in f.tensors}
        for k in list(multi):
            if len(multi[k]) == 1 and multi[k][0]["shape"] == shapes[k]:
                single[k] = multi.pop(k)[0]["xxh3"]
        stems = {local_stem(loc["rank"]) for loc in self.local}  # rank-local files get no HF index, as in ranks.py
        files = write_side_files(self.folder, replace(plan, index={k: v for k, v in plan.index.items() if k not in stems}),
                                 info["skeleton"], opts.extra_files)
        for r in sorted(ranks):
            files.update(ranks[r].get("side", {}))  # rank-local skeletons (local_keys)
        tensors = tensor_entries(plan, single, info["entries"])
        for loc in self.local:
            for k, e in loc["entries"].items():
                tensors[k] = {**tensors.get(k, {}), **e}
        for k, cs in multi.items():
            tensors[k].pop("xxh3", None)
            tensors[k]["chunks"] = sorted(cs, key=lambda c: c["offsets"])
            if k in info.get("placement", {}):  # informational (docs/FORMAT.md, "Version 2")
                tensors[k]["placement"] = info["placement"][k]
        manifest = manifest_doc(opts, files, tensors, world_size=len(results))
        if multi:
            manifest["format_version"] = CHUNKS_FORMAT_VERSION
        written_by: dict[str, list[int]] = {}
        for r in sorted(ranks):
            for name in ranks[r]["files"]:
                written_by.setdefault(name, []).append(r)
        manifest["distributed"] = {
            "mode": "rename", "node": None, "nodes": [os.environ.get("FASTCKPT_NODE") or socket.gethostname()],
            "written_by": written_by, "bytes_by_rank": {str(r): ranks[r]["bytes"] for r in sorted(ranks)},
            "rank_local": {"keys": list(opts.local_keys),
                           "skeletons": {str(r): n for r in sorted(ranks) for n in ranks[r].get("side", {})}},
            "shards": {}, "planner": "dcp"}
        write_manifest(self.folder, manifest)
        commit_folder(self.folder, self.path, opts)
        self.committed = True

    def storage_meta(self) -> Any:
        """None: this writer keeps no DCP storage metadata (the manifest is the metadata)."""
        return None


#: ``format_version`` of a manifest with at least one ``"chunks"`` entry (docs/FORMAT.md, "Version 2").
CHUNKS_FORMAT_VERSION = 2


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
    with open(os.path.join(path, cm.MANIFEST), "rb") as f:
        m = json.loads(f.read())
    return {"bytes_total": m.get("bytes_total", 0),
            "bytes_by_rank": {int(r): b for r, b in m.get("distributed", {}).get("bytes_by_rank", {}).items()}}
