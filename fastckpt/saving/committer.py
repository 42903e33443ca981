"""The commit side of a save (any number of ranks): the folder, each rank's report, the manifest, the decision.

By step of :mod:`fastckpt.saving.saver`'s call order:

* the folder leader: :func:`create_folder` checks free space and creates the hidden temporary
  folder (``commit="rename"``) or, for ``commit="marker"``, the final folder with an empty
  ``state.json`` marking it uncommitted;
* every rank, after its writes: :func:`rank_report` (checksums of the tensors whose first
  byte it wrote, its local skeleton file and entries, bytes written);
* rank 0: :func:`decide` takes every report, writes the side files and ``manifest.json``
  last, renames (the commit) and runs ``on_commit``; or removes the folder;
* marker mode, the leader of every other node: :func:`node_commit` writes that node's
  manifest once rank 0 decided.

In one process the reports and the decision are plain calls; with several ranks they travel
through the group's store (:mod:`fastckpt.coordination`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CheckpointExistsError, InsufficientSpaceError
from ..format.layout import SavePlan
from ..storage import commit as cm
from .metadata import manifest_doc, tensor_entries, write_manifest, write_side_files
from .ranks import local_stem

if TYPE_CHECKING:
    from .options import SaveOptions


def fmt(e: BaseException) -> str:
    """``Type: message`` of an error, as reported to the other ranks."""
    return f"{type(e).__name__}: {e}"


def check_space(folder: Path, need: int) -> None:
    """Raise :class:`InsufficientSpaceError` when ``folder``'s file system has fewer than ``need`` bytes free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise InsufficientSpaceError(
            f"{folder}: {free} bytes free, the checkpoint needs {need} bytes; free space or save elsewhere")


def create_folder(path: Path, opts: SaveOptions, need_bytes: int) -> str:
    """Create the folder a save writes into; returns its path.

    ``commit="rename"``: a hidden sibling temporary folder with an owner record.
    ``commit="marker"``: ``path`` itself (replaced if ``overwrite``), marked uncommitted by an
    empty ``state.json`` until its manifest exists.

    Raises:
        InsufficientSpaceError: fewer than ``need_bytes`` + ``min_free_bytes`` free.
        CheckpointExistsError: marker mode, ``path`` exists and ``overwrite`` is false.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    check_space(path.parent, need_bytes + opts.io.min_free_bytes)
    if opts.commit == "rename":
        return cm.make_temp_dir(str(path))
    if path.exists():
        if not opts.overwrite:
            raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
        shutil.rmtree(path)
    os.makedirs(path)
    # until its manifest exists, a state.json marks the folder as an uncommitted fastckpt save
    # (without it readers would take the preallocated safetensors files for a plain HF folder)
    cm.write_small_file(os.path.join(path, cm.STATE_JSON), b"{}")
    return str(path)


def rank_report(rank: int, hashes: dict[str, str], local: Any, folder: str, nbytes: int, linked_bytes: int) -> dict:
    """What a rank tells the committer after its writes.

    Args:
        rank: the rank.
        hashes: xxh3 of every tensor whose first byte this rank wrote (global key paths).
        local: ``(skeleton, entries, shards)`` of the rank's local state (multi-rank), or ``None``.
        folder: the folder (the rank writes ``state-rank0000r.json`` there).
        nbytes: bytes this rank wrote.
        linked_bytes: bytes of files the rank hard-linked instead of writing.
    """
    report = {"ok": True, "hashes": hashes, "bytes": nbytes, "linked_bytes": linked_bytes, "files": {},
              "entries": {}, "shards": {}}
    if local is not None:
        skeleton, entries, shards = local
        report["entries"], report["shards"] = entries, shards
        if skeleton is not None:
            name = f"state-rank{rank:05d}.json"
            data = json.dumps(skeleton, separators=(",", ":")).encode()
            cm.write_small_file(os.path.join(folder, name), data)
            report["files"][name] = {"bytes": len(data), "xxh3": xxhash.xxh3_64(data).hexdigest()}
            report["bytes"] += len(data)
    return report


def _local_file(name: str, world: int) -> int | None:
    head = name.split("-", 1)[0]
    for r in range(world):
        if head == local_stem(r):
            return r
    return None


def write_metadata(folder: str, plan: SavePlan, files_here: tuple[int, ...] | None, skeleton: Any,
                   entries: dict[str, dict], opts: SaveOptions, reports: dict[int, dict], *, world: int,
                   dist: dict | None) -> int:
    """Write ``state.json``, index and extra files, then ``manifest.json`` (last). Returns bytes of all files.

    Args:
        folder: the folder being committed.
        plan: the global plan; ``files_here``: the indexes of its files in this folder (``None``: all).
        skeleton: the replicated state's JSON skeleton.
        entries: alias/view/ndarray manifest entries of the replicated state.
        reports: rank -> :func:`rank_report` of the ranks whose files are in this folder.
        world: ranks of the save; ``dist``: the manifest's ``distributed`` section (multi-rank).
    """
    here = range(len(plan.files)) if files_here is None else files_here
    shared = [plan.files[i] for i in here if _local_file(plan.files[i].name, world) is None]
    own = [plan.files[i] for i in here if _local_file(plan.files[i].name, world) is not None]
    stems = {f.name.split("-", 1)[0] for f in own}
    rep_plan = replace(plan, files=tuple(shared), index={k: v for k, v in plan.index.items() if k not in stems})
    files = write_side_files(folder, rep_plan, skeleton, opts.extra_files, replace=opts.commit == "marker")
    files.update({f.name: {"bytes": f.size} for f in own})
    hashes: dict[str, str] = {}
    all_entries = dict(entries)
    for rep in reports.values():
        hashes.update(rep["hashes"])
        files.update(rep["files"])
        all_entries.update(rep["entries"])
    tensors = tensor_entries(replace(plan, files=tuple(shared + own)), hashes, {})
    for k, e in all_entries.items():
        tensors[k] = {**tensors.get(k, {}), **e}
    manifest = manifest_doc(opts, files, tensors, world_size=world)
    if dist is not None:
        manifest["distributed"] = dist
    return write_manifest(folder, manifest)


def dist_section(plan: SavePlan, units: dict[int, tuple[int, ...]], reports: dict[int, dict], *, mode: str,
                 node: str, nodes: list[str], local_keys: tuple[str, ...]) -> dict:
    """The manifest's ``distributed`` section (docs/FORMAT.md, "Multi-rank")."""
    written_by: dict[str, list[int]] = {}
    shards: dict[str, dict] = {}
    skeletons: dict[str, str] = {}
    for r, rep in sorted(reports.items()):
        for i in units.get(r, ()):
            ranks = written_by.setdefault(plan.files[plan.units[i].file_index].name, [])
            if r not in ranks:
                ranks.append(r)
        for name in rep["files"]:
            written_by[name] = [r]
            skeletons[str(r)] = name
        for kp, piece in rep["shards"].items():
            entry = shards.setdefault(kp, {"dtype": piece["dtype"], "global_shape": piece["global_shape"], "pieces": []})
            entry["pieces"].append({"rank": r, "key": piece["key"], "offsets": piece["offsets"], "shape": piece["shape"]})
    return {"mode": mode, "node": node if mode == "marker" else None, "nodes": nodes, "written_by": written_by,
            "bytes_by_rank": {str(r): rep["bytes"] for r, rep in sorted(reports.items())},
            "rank_local": {"keys": list(local_keys), "skeletons": skeletons}, "shards": shards}


def commit_folder(folder: str, path: Path, opts: SaveOptions) -> None:
    """The commit: drop the owner record and rename the temporary folder into place (rename mode)."""
    if opts.commit == "rename":
        os.unlink(os.path.join(folder, cm.OWNER))
        cm.commit_dir(folder, str(path), overwrite=opts.overwrite)


def remove_uncommitted(folder: str | None, opts: SaveOptions) -> None:
    """Remove a folder that will not be committed (marker mode: only while it has no manifest)."""
    if folder and os.path.isdir(folder) and (
            opts.commit == "rename" or not os.path.exists(os.path.join(folder, cm.MANIFEST))):
        shutil.rmtree(folder, ignore_errors=True)
