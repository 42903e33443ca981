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
  manifest once rank 0 decided;
* every rank: :func:`finish_ranks` publishes its report and waits for the outcome;
  :func:`commit_single` is the whole step in one process.

In one process the reports and the decision are plain calls; with several ranks they travel
through the group's store (:mod:`fastckpt.coordination`).
"""

from __future__ import annotations

import errno
import functools
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import xxhash

from ..coordination import Coordinator, PathClaim, Session
from ..errors import (CheckpointExistsError, DistributedSaveError, FastCkptError, FolderNotWritableError,
                      InsufficientSpaceError, NotAFolderError, PeerFailedError)
from ..format.layout import SavePlan
from ..storage.commit import MANIFEST, STATE_JSON
from ..storage.retention import freed_shard_bytes
from ..storage.store import LOCAL, Store, strategy
from ..storage.tier import tier_for
from .collect import Collected
from .future import SaveFuture
from .job import Part, SaveJob
from ..format.manifest import FileEntry, TensorChunk, parse_distributed
from .metadata import manifest_doc, merge_entry, tensor_entries, write_manifest, write_side_files
from .options import SaveOptions
from .ranks import Ownership, local_stem


def fmt(e: BaseException) -> str:
    """``Type: message`` of an error, as reported to the other ranks."""
    return f"{type(e).__name__}: {e}"


def folder_error(path: Path, e: OSError) -> FastCkptError | None:
    """The typed error for an ``OSError`` met while creating the checkpoint ``path`` (its folder, a
    parent, the hidden temporary, a root's lock file), naming ``path`` and the folder at fault;
    ``None`` for other errors (re-raise them as they are).

    Returns:
        :class:`NotAFolderError` where a parent of ``path`` is a file;
        :class:`FolderNotWritableError` for ``EACCES`` / ``EPERM`` / ``EROFS``.
    """
    if isinstance(e, FileNotFoundError):
        return None
    here = Path(path).parent
    while not LOCAL.exists(str(here)) and here != here.parent:  # the deepest folder that exists
        here = here.parent
    if LOCAL.exists(str(here)) and not LOCAL.isdir(str(here)):
        return NotAFolderError(f"cannot save '{path}': {here} is a file, not a folder; save under "
                               "another path or move the file", path=str(path), file=str(here))
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "is on a read-only file system" if e.errno == errno.EROFS else \
            "is not writable by this process (permissions, or an immutable attribute)"
        return FolderNotWritableError(
            f"cannot save '{path}': {here} {why} ({e.strerror}); save under a folder you can "
            "write to, or fix its permissions / mount", path=str(path), folder=str(here), errno=e.errno)
    return None


def _names_the_folder_asked_for(fn):
    """Raise :func:`folder_error`'s typed error for an ``OSError`` of :func:`create_folder` (which
    would name the hidden temporary folder or a parent)."""

    @functools.wraps(fn)
    def wrapper(path: Path, *args: Any, **kwargs: Any) -> str:
        try:
            return fn(path, *args, **kwargs)
        except OSError as e:
            typed = None if isinstance(e, FastCkptError) else folder_error(path, e)
            if typed is None:
                raise
            raise typed from e

    return wrapper


def check_space(folder: Path, need: int, store: Store = LOCAL) -> None:
    """Raise :class:`InsufficientSpaceError` when ``folder``'s file system has fewer than ``need`` bytes
    free. ``folder`` need not exist yet: its nearest existing parent is measured (so a refused save
    creates no folders)."""
    probe = folder
    while not store.exists(str(probe)) and probe.parent != probe:
        probe = probe.parent
    free = store.free_bytes(str(probe))
    if free < need and store.without_storage(str(probe)):  # /proc, /sys: not a full disk
        raise FolderNotWritableError(
            f"{probe} is on a file system without storage (a pseudo file system such as /proc or /sys): no "
            "checkpoint can be saved under it; save to a folder on a disk", path=str(folder), folder=str(probe))
    if free < need:
        raise InsufficientSpaceError(
            f"{folder}: {free} bytes free, the checkpoint needs {need} bytes; free space or save elsewhere")


@_names_the_folder_asked_for
def create_folder(path: Path, opts: SaveOptions, need_bytes: int, names: Iterable[str] = ()) -> str:
    """Create the folder a save writes into, with the sub-folders of ``names`` and of the extra
    files (``"second/adapter_model.safetensors"``: peft's second adapter); returns its path.

    ``commit="rename"``: a hidden sibling temporary folder with an owner record.
    ``commit="marker"``: ``path`` itself (replaced if ``overwrite``), marked uncommitted by an
    empty ``state.json`` until its manifest exists.

    Raises:
        InsufficientSpaceError: fewer than ``need_bytes`` + ``min_free_bytes`` free.
        CheckpointExistsError: marker mode, ``path`` exists and ``overwrite`` is false.
        FolderNotWritableError: the folder ``path`` goes in is read-only or not writable (names
            ``path`` and that folder, never the hidden temporary).
        NotAFolderError: a parent of ``path`` is a file.
    """
    store = LOCAL
    check_space(path.parent, need_bytes + opts.io.min_free_bytes, store)  # before any folder is made
    store.makedirs(str(path.parent))
    # sub-folders are fsynced by fastckpt.saving.metadata.write_side_files before the manifest
    return strategy(opts.commit).begin(store, str(path), overwrite=opts.overwrite,
                                       subfolders=[*names, *(opts.extra_files or ())])


def rank_report(rank: int, hashes: dict[str, str], local: Any, folder: str, nbytes: int, linked_bytes: int) -> dict:
    """What a rank tells the committer after its writes.

    Args:
        rank: the rank.
        hashes: xxh3 of every tensor whose first byte this rank wrote (global key paths).
        local: ``(skeleton, entries)`` of the rank's local state (multi-rank), or ``None``.
        folder: the folder (the rank writes ``state-rank0000r.json`` there).
        nbytes: bytes this rank wrote.
        linked_bytes: bytes of files the rank hard-linked instead of writing.
    """
    report = {"ok": True, "hashes": hashes, "bytes": nbytes, "linked_bytes": linked_bytes, "files": {},
              "entries": {}}
    if local is not None:
        skeleton, entries = local
        report["entries"] = entries
        if skeleton is not None:
            name = f"state-rank{rank:05d}.json"
            data = json.dumps(skeleton, separators=(",", ":")).encode()
            LOCAL.write_file(LOCAL.join(folder, name), data)
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
                   dist: dict | None, extra: dict[str, bytes] | None = None) -> int:
    """Write ``state.json``, index and extra files, then ``manifest.json`` (last). Returns bytes of all files.

    Args:
        folder: the folder being committed.
        plan: the global plan; ``files_here``: the indexes of its files in this folder (``None``: all).
        skeleton: the replicated state's JSON skeleton.
        entries: alias/view/ndarray manifest entries of the replicated state.
        reports: rank -> :func:`rank_report` of the ranks whose files are in this folder.
        world: ranks of the save; ``dist``: the manifest's ``distributed`` section (multi-rank).
        extra: small files written beside ``opts.extra_files`` (the DCP drop-in's ``dcp_metadata.json``).
    """
    here = range(len(plan.files)) if files_here is None else files_here
    shared = [plan.files[i] for i in here if _local_file(plan.files[i].name, world) is None]
    own = [plan.files[i] for i in here if _local_file(plan.files[i].name, world) is not None]
    stems = {f.name.split("-", 1)[0] for f in own}
    rep_plan = replace(plan, files=tuple(shared), index={k: v for k, v in plan.index.items() if k not in stems})
    files = write_side_files(folder, rep_plan, skeleton, {**(opts.extra_files or {}), **(extra or {})},
                             replace=strategy(opts.commit).replaces_files)
    files.update({f.name: FileEntry(f.size) for f in own})
    hashes: dict[str, str] = {}
    all_entries = dict(entries)
    for rep in reports.values():
        hashes.update(rep["hashes"])
        files.update({n: FileEntry(**d) for n, d in rep["files"].items()})
        all_entries.update(rep["entries"])
    tensors = tensor_entries(replace(plan, files=tuple(shared + own)), hashes, {})
    for k, e in all_entries.items():
        tensors[k] = merge_entry(tensors.get(k), e)
    chunks: dict[str, list[dict]] = {}  # tensors written in chunks by several ranks (DTensors)
    for rep in reports.values():
        for k, cs in rep.get("chunks", {}).items():
            chunks.setdefault(k, []).extend(cs)
    for k, cs in chunks.items():  # format 2 (Manifest.version derives it from the chunks)
        entry = tensors[k]
        entry.xxh3 = None
        entry.chunks = [TensorChunk(tuple(c["offsets"]), tuple(c["shape"]), c["xxh3"])
                        for c in sorted(cs, key=lambda c: c["offsets"])]
        placement = next((rep["placement"][k] for rep in reports.values() if k in rep.get("placement", {})), None)
        if placement is not None:  # informational (docs/FORMAT.md, "Version 2")
            entry.placement = placement
    manifest = manifest_doc(opts, files, tensors, world_size=world,
                            distributed=None if dist is None else parse_distributed(dist))
    return write_manifest(folder, manifest)


def dist_section(plan: SavePlan, units: dict[int, tuple[int, ...]], reports: dict[int, dict], *, mode: str,
                 node: str, nodes: list[str], local_keys: tuple[str, ...], planner: str | None = None) -> dict:
    """The manifest's ``distributed`` section (docs/FORMAT.md, "Multi-rank"): the one builder of it.

    Args:
        units: rank -> write units it wrote (plain states); a report's ``"written"`` (file names) counts too.
        planner: ``"dcp"`` when DCP's planner placed the chunks (the DCP drop-in), else ``None`` (not recorded).
    """
    written_by: dict[str, list[int]] = {}
    skeletons: dict[str, str] = {}
    for r, rep in sorted(reports.items()):
        for i in units.get(r, ()):
            ranks = written_by.setdefault(plan.files[plan.units[i].file_index].name, [])
            if r not in ranks:
                ranks.append(r)
        for name in rep.get("written", ()):  # chunked saves: the files holding pages this rank wrote
            written_by.setdefault(name, []).append(r)
        for name in rep["files"]:
            written_by[name] = [r]
            skeletons[str(r)] = name
    return {"mode": mode, "node": node if strategy(mode).per_node else None, "nodes": nodes, "written_by": written_by,
            "bytes_by_rank": {str(r): rep["bytes"] for r, rep in sorted(reports.items())},
            "rank_local": {"keys": list(local_keys), "skeletons": skeletons},
            **({"planner": planner} if planner else {})}


def commit_folder(folder: str, path: Path, opts: SaveOptions) -> None:
    """The commit of ``folder`` (its manifest written) as ``path``, by the save's strategy
    (:mod:`fastckpt.storage.store`: rename into place, or nothing more for a marker). A checkpoint
    it replaces (``overwrite``) gives the shard bytes its removal frees back to the tier's count,
    as retention does (else every overwrite of ``last`` added to the stored bytes)."""
    p = str(path)
    replaced = freed_shard_bytes(p) if opts.overwrite and LOCAL.isdir(p) else 0
    strategy(opts.commit).finish(LOCAL, folder, p, overwrite=opts.overwrite)
    if replaced:
        parent = LOCAL.parent(LOCAL.normalize(p))
        tier_for(parent).add_stored("checkpoints", parent, -replaced)


def remove_uncommitted(folder: str | None, opts: SaveOptions) -> None:
    """Remove a folder that will not be committed (never one whose marker committed it)."""
    strategy(opts.commit).abort(LOCAL, folder)


@dataclass
class InFlight:
    """Everything of one save in flight on this rank, filled in by the saver's steps, read by the commit steps."""

    coord: Coordinator
    sess: Session
    path: Path
    opts: SaveOptions
    fut: SaveFuture
    t0: float
    claim: PathClaim | None = None
    col: Collected | None = None  # the replicated state (one process: the whole state)
    sources: dict = field(default_factory=dict)  # global key path -> tensor (local ones under RANK_KEY)
    frozen: set = field(default_factory=set)
    trainable: set = field(default_factory=set)
    local: tuple | None = None  # multi-rank: (skeleton, entries) of the rank-local state
    plan: SavePlan | None = None
    own: Ownership | None = None
    part: Part = field(default_factory=Part)
    job: SaveJob | None = None
    folder: str | None = None
    nodes: list = field(default_factory=list)
    stage_exc: BaseException | None = None
    placement: dict = field(default_factory=dict)  # DTensor key path -> mesh shape and placements (manifest)
    header_bytes: int = 0  # bytes of file headers this rank wrote when it created the files (chunked saves)

    @property
    def single(self) -> bool:
        return self.coord.is_single


def commit_single(sv: InFlight, report: dict) -> None:
    """Step 5 in one process: manifest last, rename, ``on_commit``."""
    fut, opts = sv.fut, sv.opts
    if sv.claim is not None:
        sv.claim.check()
    dist = None if sv.local is None else dist_section(
        sv.plan, {0: tuple(range(len(sv.plan.units)))}, {0: report}, mode=opts.commit, node=sv.coord.node,
        nodes=sv.nodes, local_keys=opts.local_keys)
    fut.bytes_written = write_metadata(sv.folder, sv.plan, None, sv.col.skeleton, sv.col.entries, opts,
                                       {0: report}, world=1, dist=dist)
    fut.bytes_linked = report["linked_bytes"]
    fut.bytes_by_rank = {0: report["bytes"]}
    commit_folder(sv.folder, sv.path, opts)
    fut.total_s = time.perf_counter() - sv.t0
    if opts.on_commit is not None:
        opts.on_commit(sv.path)

def finish_ranks(sv: InFlight, report: dict, own: BaseException | None) -> None:
    """Steps 4-5 of a multi-rank save: report, rank 0 decides, every rank learns the outcome."""
    sess, coord, opts = sv.sess, sv.coord, sv.opts
    sess.restart_clock()
    rollback = False
    try:
        sess.publish(f"done/{coord.rank}", report)
        if coord.rank == 0:
            decide(sv)
        elif strategy(opts.commit).per_node and sv.part.leader:
            node_commit(sv)
        outcome = _wait_outcome(sv)
    except TimeoutError as e:  # rank 0 (the committer) died or hung: nothing was committed
        raise DistributedSaveError(f"multi-rank save of {sv.path} failed: rank 0 did not publish the "
                                   f"outcome ({e})", {0: str(e)}) from own
    # rank 0 wrote no marker: this node's marker (if any) names an uncommitted step, remove it
    rollback = not outcome["ok"] and not outcome.get("committed", False)
    if not outcome["ok"]:
        if strategy(opts.commit).per_node and sv.part.leader and rollback:
            LOCAL.remove(sv.folder)
        failures = {int(r): e for r, e in outcome["failures"].items()}
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
        raise DistributedSaveError(f"multi-rank save of {sv.path} failed: {lines}", failures) from own
    fut = sv.fut
    fut.total_s = time.perf_counter() - sv.t0
    fut.bytes_written = outcome.get("bytes_total", 0)
    fut.bytes_linked = outcome.get("bytes_linked", 0)
    fut.bytes_by_rank = {int(r): b for r, b in outcome.get("bytes_by_rank", {}).items()}

def check_target(path: Any, overwrite: bool, store: Store = LOCAL, hint: str = "") -> None:
    """Refuse a save into an existing ``path`` unless ``overwrite`` is set and ``path`` is something a
    save may replace: a fastckpt checkpoint (its ``manifest.json``), the folder of an uncommitted
    ``commit="marker"`` save (its ``state.json`` marker, no manifest yet) or an empty folder.
    ``overwrite=True`` never removes other files (a file, or a folder of someone else's files would be
    deleted by the swap). Only names are looked at (nothing parsed in the caller's blocking time).

    Args:
        hint: appended to the "already exists" message (e.g. what a multi-rank save must pass).

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false, or it is not replaceable
            (names what is there and how to proceed).
    """
    p = str(path)
    if not store.lexists(p):
        return
    folder = store.isdir(p)
    if folder:
        names = store.listdir(p)
        replaceable = not names or MANIFEST in names or STATE_JSON in names
    else:
        replaceable = False
    if replaceable and not overwrite:
        raise CheckpointExistsError(f"{p} already exists; pass overwrite=True to replace it atomically{hint}")
    if replaceable:
        return
    what = "a folder" if folder else "a file"
    raise CheckpointExistsError(  # overwrite or not: pointing at overwrite=True would only fail again
        f"{p} exists and is {what} that is not a fastckpt checkpoint (no manifest.json): a save replaces "
        "only a checkpoint or an empty folder (overwrite=True), never other files. Save to another path, "
        "or remove it yourself if it may go")


def failed_report(exc: BaseException) -> dict:
    """The report of a rank whose part of a multi-rank save failed with ``exc``; a failure caused by
    another rank's (:class:`~fastckpt.errors.PeerFailedError`) names that rank as ``peer``."""
    report = {"ok": False, "error": fmt(exc)}
    if isinstance(exc, PeerFailedError):
        report["peer"] = exc.rank
    return report


def _first_failure_in(got: dict[str, dict]) -> bool:
    """True once ``got`` (store key -> report) holds a failure of its own: a failed report that names
    no ``peer``, or whose peer's report is there too (the failures then name the rank that failed first)."""
    return any(not v["ok"] and (v.get("peer") is None or f"done/{v['peer']}" in got) for v in got.values())


def _wait_reports(sv: InFlight, ranks: list[int], what: str) -> tuple[dict[int, dict], dict[int, str]]:
    """The ranks' reports; stops at the first failure of its own (the save fails at once, not when
    the slowest rank is done; a rank failing because another did waits for that rank's report) or at
    the deadline (missing ranks are failures)."""
    got, missing = sv.sess.wait_until([f"done/{r}" for r in ranks], _first_failure_in)
    reports = {int(k.rsplit("/", 1)[1]): v for k, v in got.items()}
    if any(not v["ok"] for v in reports.values()):
        return reports, {}
    return reports, {int(k.rsplit("/", 1)[1]): f"no report within {sv.sess.timeout_s:g} s after rank 0's "
                                                 f"writes while {what} (died or hung?)" for k in missing}


def _wait_outcome(sv: InFlight) -> dict:
    """Wait for rank 0's outcome. At the deadline, settle ``verdict`` to "abort" (rank 0 then
    commits nothing) unless rank 0 settled it to "commit" first: then it is committing, wait on.
    Every rank thus sees the same outcome, even when it gives up waiting."""
    sess = sv.sess
    try:
        return sess.wait_for(["commit"], "waiting for rank 0's commit")[0]
    except TimeoutError:
        if sess.settle("verdict", f"abort by rank {sv.coord.rank}") != "commit":
            raise
    # rank 0 is committing (manifest, rename, on_commit: retention may delete large folders): wait
    # _COMMIT_GRACE more windows of timeout_s before calling it dead
    end = time.monotonic() + _COMMIT_GRACE * sess.timeout_s
    while True:
        sess.restart_clock()
        try:
            return sess.wait_for(["commit"], "waiting for rank 0 to finish its commit")[0]
        except TimeoutError:
            if time.monotonic() >= end:
                raise


#: Windows of ``timeout_s`` a rank keeps waiting once rank 0 has started to commit (:func:`_wait_outcome`).
_COMMIT_GRACE = 3


def decide(sv: InFlight) -> None:
    """Rank 0: wait for every rank, then commit (manifest + rename, or markers) or abort."""
    sess, coord, opts = sv.sess, sv.coord, sv.opts
    reports, failures = _wait_reports(sv, list(range(coord.world_size)), "waiting for every rank's writes")
    failures.update({r: rep["error"] for r, rep in reports.items() if not rep["ok"]})
    committed, total = False, 0
    sess.publish("decision", {"ok": not failures})
    if not failures:
        mine = {r: rep for r, rep in reports.items() if r in sv.own.group}
        try:
            if strategy(opts.commit).per_node:
                acks = sess.wait_for([f"marked/{n}" for n in sv.nodes[1:]], "waiting for the other nodes' markers")
                failures.update({int(r): e for a in acks for r, e in a.get("failures", {}).items()})
            verdict = sess.settle("verdict", "commit") if not failures else "commit"
            if verdict != "commit":  # "abort by rank r": it gave up waiting for this commit
                r = int(verdict.rsplit(" ", 1)[-1])
                failures[r] = f"gave up waiting for rank 0's commit after timeout_s={sess.timeout_s:g} s"
            if not failures:
                dist = dist_section(sv.plan, sv.own.units, mine, mode=opts.commit, node=coord.node,
                                    nodes=sv.nodes, local_keys=opts.local_keys)
                total = write_metadata(sv.folder, sv.plan, sv.own.files, sv.col.skeleton, sv.col.entries, opts,
                                       mine, world=coord.world_size, dist=dist)
                commit_folder(sv.folder, sv.path, opts)
                committed = True
        except BaseException as e:
            failures[0] = f"commit: {fmt(e)}"
        if not failures and opts.on_commit is not None:
            try:  # before the outcome is published: every rank returns after retention/`latest` ran
                opts.on_commit(sv.path)
            except BaseException as e:
                failures[0] = f"on_commit hook (the checkpoint itself is committed): {fmt(e)}"
    if failures:
        remove_uncommitted(sv.folder, opts)
    sess.publish("commit", {"ok": not failures, "committed": committed,
                            "failures": {str(r): e for r, e in failures.items()},
                            "bytes_total": total, "bytes_linked": sum(r.get("linked_bytes", 0) for r in reports.values()),
                            "bytes_by_rank": {str(r): rep.get("bytes", 0) for r, rep in reports.items()}})

def node_commit(sv: InFlight) -> None:
    """Leader of another node in marker mode: write this node's manifest once rank 0 decided."""
    sess, coord, opts = sv.sess, sv.coord, sv.opts
    decision = sess.wait_for(["decision"], "waiting for rank 0's decision")[0]
    failures: dict[str, str] = {}
    if decision["ok"]:
        reports, missing = _wait_reports(sv, list(sv.own.group), "reading the node's reports")
        try:
            if missing:
                raise TimeoutError(f"ranks {sorted(missing)} did not report")
            dist = dist_section(sv.plan, sv.own.units, reports, mode=opts.commit, node=coord.node, nodes=sv.nodes,
                                local_keys=opts.local_keys)
            write_metadata(sv.folder, sv.plan, sv.own.files, sv.col.skeleton, sv.col.entries, opts, reports,
                           world=coord.world_size, dist=dist)
        except BaseException as e:
            failures[str(coord.rank)] = f"commit marker: {fmt(e)}"
    sess.publish(f"marked/{coord.node}", {"failures": failures})
