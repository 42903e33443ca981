"""Commit side of a multi-rank save: the checkpoint folder, what each rank reports, the manifest.

Split out of :mod:`fastckpt.saving.ranks` (which splits and plans the state, runs each rank's
writes and orders the steps); the call order of one save is in that module's docstring.
Here, by step:

* step 2, the folder leader: :func:`_create_folder` checks free space and creates the folder
  (a hidden temp folder for ``commit="rename"``; the final path with an empty ``state.json``
  marking it uncommitted for ``commit="marker"``) with every replicated file preallocated;
* step 4, every rank: :func:`_rank_report` writes the rank's ``state-rankNNNNN.json`` and
  builds its ``done/{rank}`` report (checksums, own files, own tensors under
  :data:`RANK_KEY`, shard pieces);
* step 5, rank 0: :func:`_decide` waits for every report, then writes the manifest and renames
  (or, in marker mode, waits for every other node's marker and writes its own last), or
  removes the folder; it publishes ``decision`` and ``commit``;
* step 5, marker mode, the leader of every other node: :func:`_node_commit` writes that
  node's manifest once rank 0 decided, and publishes ``marked/{node}``;
* :func:`_write_manifest` merges the reports into ``manifest.json`` (written last) plus the
  side files; see docs/FORMAT.md ("Multi-rank").
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from ..storage import commit as cm
from ..errors import CheckpointExistsError, InsufficientSpaceError
from ..storage.io import get_backend
from .metadata import manifest_doc, tensor_entries, write_manifest, write_side_files
from ..format.tree import join

if TYPE_CHECKING:  # annotations only: dist_save imports this module
    from .ranks import _Prep
    from .saver import SaveOptions

RANK_KEY = "@rank{}/"


def _fmt(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _create_folder(path: Path, prep: _Prep, opts: SaveOptions, mode: str, local_bytes: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(path.parent)
    need = prep.plan.file_bytes + local_bytes + opts.min_free_bytes
    if st.f_bavail * st.f_frsize < need:
        raise InsufficientSpaceError(f"{path.parent}: {st.f_bavail * st.f_frsize} bytes free, the checkpoint "
                                     f"needs {need} bytes; free space or save elsewhere")
    if mode == "rename":
        folder = cm.make_temp_dir(str(path))
    else:
        if path.exists():
            if not opts.overwrite:
                raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
            shutil.rmtree(path)
        os.makedirs(path)
        folder = str(path)
        # until its manifest exists, a state.json marks the folder as an uncommitted fastckpt save
        # (without it readers would take the preallocated safetensors files for a plain HF folder)
        cm.write_small_file(os.path.join(folder, cm.STATE_JSON), b"{}")
    be = get_backend(opts.io_backend)
    for f in prep.plan.files:
        fd = be.open_write(os.path.join(folder, f.name))
        try:
            be.allocate(fd, f.size)
        finally:
            be.close(fd)
    return folder


def _rank_report(prep: _Prep, rank: int, hashes: dict[str, str], folder: str, nbytes: int) -> dict:
    """What rank ``rank`` tells the committer: hashes of replicated tensors, its own files and tensors."""
    pre = RANK_KEY.format(rank)
    loc_keys = {t.spec.key for f in prep.loc_plan.files for t in f.tensors}
    files = {f.name: {"bytes": f.size} for f in prep.loc_plan.files}
    tensors: dict[str, dict] = {}
    for f in prep.loc_plan.files:
        for t in f.tensors:
            s = t.spec
            tensors[pre + s.key] = {"file": f.name, "name": s.name, "dtype": s.dtype, "shape": list(s.shape),
                                    "offsets": [t.file_offset, t.file_offset + s.nbytes], "xxh3": hashes[s.key]}
    for k, e in prep.loc.entries.items():
        e = dict(e)
        for ref in ("alias", "view"):
            if ref in e:
                e[ref] = pre + e[ref]
        tensors[pre + k] = {**tensors.get(pre + k, {}), **e}
    if prep.loc.specs or prep.loc.entries:
        name = f"state-rank{rank:05d}.json"
        data = json.dumps(prep.loc.skeleton, separators=(",", ":")).encode()
        cm.write_small_file(os.path.join(folder, name), data)
        files[name] = {"bytes": len(data), "xxh3": xxhash.xxh3_64(data).hexdigest()}
        nbytes += len(data)
    shards = {kp: {**v, "dtype": next(s.dtype for s in prep.loc.specs if s.key == join("shards", kp)),
                   "key": pre + join("shards", kp)} for kp, v in prep.split.shards.items()}
    rep_hashes = {k: v for k, v in hashes.items() if k not in loc_keys}
    return {"ok": True, "hashes": rep_hashes, "files": files, "tensors": tensors, "shards": shards,
            "bytes": nbytes}


def _write_manifest(folder: str, prep: _Prep, opts: SaveOptions, reports: dict[int, dict], *,
                    world: int, mode: str, node: str, nodes: list[str], runs: dict[int, tuple[int, int]],
                    local_keys: tuple[str, ...]) -> int:
    """Write state.json, index and extra files, then ``manifest.json`` (last). Returns bytes of all files."""
    plan = prep.plan
    files = write_side_files(folder, plan, prep.rep.skeleton, opts.extra_files, replace=mode == "marker")
    hashes: dict[str, str] = {}
    for rep in reports.values():
        hashes.update(rep["hashes"])
    tensors = tensor_entries(plan, hashes, prep.rep.entries)
    written_by: dict[str, list[int]] = {}
    shards: dict[str, dict] = {}
    skeletons: dict[str, str] = {}
    for r, rep in sorted(reports.items()):
        a, b = runs.get(r, (0, 0))
        for u in plan.units[a:b]:
            ranks = written_by.setdefault(plan.files[u.file_index].name, [])
            if r not in ranks:
                ranks.append(r)
        for name in rep["files"]:
            written_by[name] = [r]
            if name.startswith("state-rank"):
                skeletons[str(r)] = name
        files.update(rep["files"])
        tensors.update(rep["tensors"])
        for kp, piece in rep["shards"].items():
            entry = shards.setdefault(kp, {"dtype": piece["dtype"], "global_shape": piece["global_shape"], "pieces": []})
            entry["pieces"].append({"rank": r, "key": piece["key"], "offsets": piece["offsets"], "shape": piece["shape"]})
    manifest = manifest_doc(opts, files, tensors, world_size=world)
    manifest["distributed"] = {"mode": mode, "node": node if mode == "marker" else None, "nodes": nodes,
                                "written_by": written_by,
                                "bytes_by_rank": {str(r): rep["bytes"] for r, rep in sorted(reports.items())},
                                "rank_local": {"keys": list(local_keys), "skeletons": skeletons},
                                "shards": shards}
    return write_manifest(folder, manifest)


def _decide(sess, coord, prep, path, opts, folder, mode, runs, nodes, local_keys, fut) -> None:
    """Rank 0: wait for every rank, then commit (manifest + rename, or markers) or abort."""
    world = coord.world_size
    reports = dict(enumerate(sess.wait_for([f"done/{r}" for r in range(world)], "waiting for every rank's writes")))
    failures = {r: rep["error"] for r, rep in reports.items() if not rep["ok"]}
    committed = False
    if not failures:
        sess.publish("decision", {"ok": True})
        mine = {r: rep for r, rep in reports.items() if r in runs}
        try:
            if mode == "marker":
                acks = sess.wait_for([f"marked/{n}" for n in nodes[1:]], "waiting for the other nodes' markers")
                failures.update({int(r): e for a in acks for r, e in a.get("failures", {}).items()})
            if not failures:
                _write_manifest(folder, prep, opts, mine, world=world, mode=mode, node=coord.node, nodes=nodes,
                                runs=runs, local_keys=local_keys)
                if mode == "rename":
                    os.unlink(os.path.join(folder, cm.OWNER))
                    cm.commit_dir(folder, str(path), overwrite=opts.overwrite)
                committed = True
        except BaseException as e:
            failures[0] = f"commit: {_fmt(e)}"
        if not failures and opts.on_commit is not None:
            try:  # before the outcome is published: every rank returns after retention/`latest` ran
                opts.on_commit(path)
            except BaseException as e:
                failures[0] = f"on_commit hook (the checkpoint itself is committed): {_fmt(e)}"
    else:
        sess.publish("decision", {"ok": False})
    if failures and os.path.isdir(folder) and (mode == "rename" or not os.path.exists(os.path.join(folder, cm.MANIFEST))):
        shutil.rmtree(folder, ignore_errors=True)
    sess.publish("commit", {"ok": not failures, "committed": committed,
                            "failures": {str(r): e for r, e in failures.items()}})


def _node_commit(sess, coord, prep, opts, folder, group, runs, nodes, local_keys) -> None:
    """Leader of another node in marker mode: write this node's manifest once rank 0 decided."""
    decision = sess.wait_for(["decision"], "waiting for rank 0's decision")[0]
    failures: dict[str, str] = {}
    if decision["ok"]:
        reports = dict(zip(group, sess.wait_for([f"done/{r}" for r in group], "reading the node's reports")))
        try:
            _write_manifest(folder, prep, opts, reports, world=coord.world_size, mode="marker", node=coord.node,
                            nodes=nodes, runs=runs, local_keys=local_keys)
        except BaseException as e:
            failures[str(coord.rank)] = f"commit marker: {_fmt(e)}"
    sess.publish(f"marked/{coord.node}", {"failures": failures})
