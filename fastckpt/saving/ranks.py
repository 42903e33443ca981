"""Multi-rank save: every rank writes part of one checkpoint; one commit makes it visible.

Call order of one save (every rank of the group, same order of saves on every rank):

1. caller thread, all ranks: split the state (replicated part / rank-local part / shards),
   validate and plan (pure, same replicated plan on every rank); store all-gather of
   ``prep`` (hosts, a digest of the replicated plan, errors). Any error -> every rank raises
   :class:`~fastckpt.errors.DistributedSaveError` before a file exists.
2. caller thread, the folder leader (rank 0, or each node's lowest rank in ``commit="marker"``
   mode): create the folder and the replicated files; store all-gather of ``open``.
3. caller thread, all ranks: stage own byte range of the replicated files + own rank-local
   tensors into host memory; ``async_save`` returns.
4. background thread, all ranks: ``pwrite`` own units, checksums, fsync; publish ``done/{rank}``.
5. background, rank 0: wait for every ``done``; all ok -> metadata, manifest last, rename
   (``commit="rename"``); publish ``commit``. Any failure -> remove the folder, publish the
   failures; every rank's ``result()`` raises ``DistributedSaveError`` listing them.

Coordination uses only the group's store (:mod:`fastckpt.coordination`), so a background save
never interleaves with the training loop's collectives.

Replicated bytes are split by write unit: the units of the single-rank plan (same files,
same headers as a one-process save) are cut into N contiguous runs of about equal bytes;
each rank writes its run with ``pwrite`` into the shared files. See docs/FORMAT.md
("Multi-rank").

What lives where: this module splits and plans the state (:class:`Shard`, :func:`split_state`,
:func:`partition_units`), runs one rank's writes (``_RankJob``), orders the steps above
(:class:`DistSaver`, ``_start``, ``_finish``) and picks a saver (:func:`make_saver`).
:mod:`fastckpt.saving.rank_commit` holds the commit side: creating the folder (step 2), each rank's
``done`` report (step 4), rank 0's decision, the manifest and the per-node markers (step 5).
``RANK_KEY`` is defined there and re-exported here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..storage import commit as cm
from .collect import Collected, collect
from .rank_commit import RANK_KEY  # noqa: F401  (re-exported: dist_load and callers import it from here)
from .rank_commit import _create_folder, _decide, _fmt, _node_commit, _rank_report
from ..coordination import DEFAULT_TIMEOUT_S, Coordinator, Session
from ..errors import CheckpointExistsError, DistributedSaveError
from ..storage.io import FileWriter, get_backend, write_all
from ..storage.memory import host_buffer
from ..format.layout import SavePlan, plan_save
from .saver import SaveFuture, SaveOptions
from ..storage.io import default_threads
from ..storage.staging import copy_into
from ..format.tree import join

_SAVE_COUNT = itertools.count(1)  # per process: saves of all DistSavers, in call order
MODES = ("rename", "marker")


@dataclass(frozen=True)
class Shard:
    """This rank's piece of a global tensor (ZeRO/FSDP/TP shard), saved by this rank only.

    Attributes:
        tensor: the local piece (any device, any dtype fastckpt stores).
        global_shape: shape of the whole tensor.
        offsets: global index of ``tensor[0, ..., 0]`` (one int per dim).
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        g, o, s = tuple(self.global_shape), tuple(self.offsets), tuple(self.tensor.shape)
        if not (len(g) == len(o) == len(s)) or any(a < 0 or a + n > m for a, n, m in zip(o, s, g)):
            raise ValueError(f"Shard of shape {s} at offsets {o} does not fit global shape {g}")


def shard_dim0(full: torch.Tensor, rank: int, world_size: int) -> Shard:
    """The ``torch.chunk(full, world_size)[rank]`` piece of ``full`` as a :class:`Shard`."""
    size = -(-full.shape[0] // world_size)
    a = min(rank * size, full.shape[0])
    piece = full[a:a + size]
    return Shard(piece, tuple(full.shape), (a,) + (0,) * (full.dim() - 1))


@dataclass
class _Split:
    replicated: Any
    local: dict
    shards: dict[str, dict]


def _strip(v: Any, path: str, shards: dict, local: dict) -> Any:
    if isinstance(v, Shard):
        local.setdefault("shards", {})[path] = v.tensor
        shards[path] = {"global_shape": list(v.global_shape), "offsets": list(v.offsets),
                        "shape": list(v.tensor.shape)}
        return {"__shard__": path}
    if isinstance(v, dict):
        return {k: _strip(x, join(path, k), shards, local) for k, x in v.items()}
    if isinstance(v, list):
        return [_strip(x, join(path, i), shards, local) for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return tuple(_strip(x, join(path, i), shards, local) for i, x in enumerate(v))
    return v


def split_state(state: Any, local_keys: tuple[str, ...]) -> _Split:
    """Separate replicated values, rank-local top-level subtrees and :class:`Shard` values."""
    shards: dict[str, dict] = {}
    local: dict = {}
    if not isinstance(state, dict):
        return _Split(_strip(state, "", shards, local), local, shards)
    rep = {}
    for k, v in state.items():
        if k in local_keys:
            local.setdefault("local", {})[k] = v
            rep[k] = {"__rank_local__": k}
        else:
            rep[k] = _strip(v, join("", k), shards, local)
    return _Split(rep, local, shards)


def partition_units(plan: SavePlan, n: int) -> list[tuple[int, int]]:
    """Cut ``plan.units`` into ``n`` contiguous runs ``[a, b)`` of about equal bytes (pure)."""
    total = sum(u.nbytes for u in plan.units)
    bounds, done, i = [0], 0, 0
    for r in range(1, n):
        goal = total * r // n
        while i < len(plan.units) and done + plan.units[i].nbytes // 2 < goal:
            done += plan.units[i].nbytes
            i += 1
        bounds.append(i)
    bounds.append(len(plan.units))
    return [(bounds[r], bounds[r + 1]) for r in range(n)]


@dataclass
class _Prep:
    split: _Split
    rep: Collected
    plan: SavePlan
    loc: Collected
    loc_plan: SavePlan
    digest: str


def _prepare(state: Any, opts: SaveOptions, local_keys: tuple[str, ...], rank: int) -> _Prep:
    split = split_state(state, local_keys)
    weights = opts.weights if opts.weights is not None else {"model": "model"}
    rep = collect(split.replicated, weights)
    plan = plan_save(rep.specs, max_shard_bytes=opts.max_shard_bytes, chunk_bytes=opts.chunk_bytes,
                     metadata=opts.metadata)
    loc = collect(split.local, {})
    stem = f"rank{rank:05d}"
    loc.specs = [replace(s, group=stem) for s in loc.specs]
    loc_plan = plan_save(loc.specs, max_shard_bytes=opts.max_shard_bytes, chunk_bytes=opts.chunk_bytes,
                         metadata=opts.metadata)
    desc = json.dumps([rep.skeleton, [(s.key, s.dtype, list(s.shape)) for s in rep.specs]], sort_keys=True)
    return _Prep(split, rep, plan, loc, loc_plan, hashlib.sha256(desc.encode()).hexdigest())


class _RankJob:
    """One rank's writes: a run of replicated units into shared files + its own local files."""

    def __init__(self, prep: _Prep, folder: str, run: tuple[int, int], leader: bool, opts: SaveOptions):
        self.prep, self.folder, self.run, self.leader, self.opts = prep, folder, run, leader, opts
        self.be = get_backend(opts.io_backend)
        self.fds: dict[int, int] = {}
        self.local: list[FileWriter] = []
        self.exec = ThreadPoolExecutor(opts.threads or default_threads(), thread_name_prefix="fastckpt-dist-io")
        self.bytes_written = 0

    def _units(self):
        a, b = self.run
        return self.prep.plan.units[a:b]

    def open(self) -> None:
        files = {u.file_index for u in self._units()} | (set(range(len(self.prep.plan.files))) if self.leader else set())
        for i in sorted(files):
            path = os.path.join(self.folder, self.prep.plan.files[i].name)
            self.fds[i] = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        for f in self.prep.loc_plan.files:
            self.local.append(FileWriter(self.be, os.path.join(self.folder, f.name), f.size, False))

    def stage(self, sources: dict, loc_sources: dict) -> None:
        """Copy the tensors this rank writes or checksums into host memory (caller blocks here)."""
        units = self._units()
        lo = units[0].stream_offset if units else 0
        hi = units[-1].stream_offset + units[-1].nbytes if units else 0
        mine = [t for f in self.prep.plan.files for t in f.tensors
                if t.spec.nbytes and t.stream_offset < hi and t.stream_offset + t.spec.nbytes > lo]
        self.owned = [t for t in mine if lo <= t.stream_offset < hi]
        self.base = min([lo] + [t.stream_offset for t in mine])
        top = max([hi] + [t.stream_offset + t.spec.nbytes for t in mine])
        self.buf, self.view = host_buffer(top - self.base)
        for t in mine:
            s = t.stream_offset - self.base
            copy_into(self.buf[s:s + t.spec.nbytes], sources[t.spec.key])
        lp = self.prep.loc_plan
        self.lbuf, self.lview = host_buffer(lp.stream_bytes)
        for f in lp.files:
            for t in f.tensors:
                copy_into(self.lbuf[t.stream_offset:t.stream_offset + t.spec.nbytes], loc_sources[t.spec.key])
        if any(getattr(t, "device", torch.device("cpu")).type == "cuda" for t in list(sources.values()) + list(loc_sources.values())):
            torch.cuda.synchronize()

    def write(self) -> dict[str, str]:
        """Write, checksum and fsync; returns xxh3 of every tensor this rank owns (both kinds)."""
        futs = [self.exec.submit(write_all, self.be, self.fds[u.file_index],
                                 self.view[u.stream_offset - self.base:u.stream_offset - self.base + u.nbytes],
                                 u.file_offset) for u in self._units()]
        lp = self.prep.loc_plan
        futs += [self.exec.submit(self.local[u.file_index].write, self.lview[u.stream_offset:u.stream_offset + u.nbytes],
                                  u.file_offset) for u in lp.units]
        hashes = {t.spec.key: self.exec.submit(self._hash, self.view, t.stream_offset - self.base, t.spec.nbytes)
                  for t in self.owned}
        hashes.update({t.spec.key: self.exec.submit(self._hash, self.lview, t.stream_offset, t.spec.nbytes)
                       for f in lp.files for t in f.tensors})
        for fu in futs:
            fu.result()
        self.bytes_written = sum(u.nbytes for u in self._units()) + lp.file_bytes
        if self.leader:
            for i, f in enumerate(self.prep.plan.files):
                write_all(self.be, self.fds[i], memoryview(f.prefix), 0)
                self.bytes_written += len(f.prefix)
        for w, f in zip(self.local, lp.files):
            write_all(self.be, w.fd, memoryview(f.prefix), 0)
        list(self.exec.map(self.be.fsync, list(self.fds.values())))
        list(self.exec.map(lambda w: w.sync(), self.local))
        return {k: v.result() for k, v in hashes.items()}

    @staticmethod
    def _hash(view: memoryview, a: int, n: int) -> str:
        return xxhash.xxh3_64(view[a:a + n]).hexdigest()

    def close(self) -> None:
        """Close files, threads and buffers; safe on any path."""
        for fd in self.fds.values():
            try:
                self.be.close(fd)
            except OSError:
                pass
        self.fds = {}
        for w in self.local:
            try:
                w.close()
            except OSError:
                pass
        self.exec.shutdown(wait=True, cancel_futures=True)
        self.buf = self.view = self.lbuf = self.lview = None


class DistSaver:
    """Multi-rank counterpart of :class:`fastckpt.saving.saver.Saver` (same ``async_save``/``wait``).

    Args:
        process_group: a ``torch.distributed`` group (``None``: the world group).

    Every rank of the group must call :meth:`async_save` for the same saves in the same order.
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._pending: SaveFuture | None = None
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return Coordinator.for_group(self.process_group).rank

    def wait(self) -> None:
        """Wait for the pending save; re-raise its failure if nobody collected it yet."""
        fut, self._pending = self._pending, None
        if fut is not None:
            fut._event.wait()
            if fut._exc is not None and not fut._collected:
                fut.result()

    def async_save(self, state: Any, path: str | os.PathLike, *, local_keys: tuple[str, ...] | list[str] = (),
                   commit: str = "rename", timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any) -> SaveFuture:
        """Save ``state`` from every rank of the group into one checkpoint at ``path``.

        Args:
            state: the rank's state. Values are replicated (equal on every rank; the bytes are
                split across ranks) except top-level keys in ``local_keys`` (each rank's own
                subtree, e.g. a ZeRO optimizer partition) and :class:`Shard` values (a piece of a
                global tensor with its placement).
            path: checkpoint folder; the same shared path on every rank (``commit="rename"``), or
                each node's own local path (``commit="marker"``).
            local_keys: top-level keys whose subtree differs between ranks.
            commit: ``"rename"`` (shared file system: one hidden folder, rank 0 renames it) or
                ``"marker"`` (node-local disks: each node writes its folder in place; its
                ``manifest.json`` is written only after every rank reported, rank 0's last).
            timeout_s: seconds to wait for the other ranks at each step (default 1800).
            **options: as :func:`fastckpt.async_save` (``staging_bytes`` and ``o_direct`` are not
                supported here).

        Raises:
            DistributedSaveError: on every rank, when any rank failed validation or setup; a failure
                while writing is raised the same way from ``result()``. ``failures`` maps rank -> error.
            ValueError: a bad option (same on every rank).
        """
        opts = SaveOptions(**options)
        opts.check()
        if opts.staging_bytes is not None:
            raise ValueError("staging_bytes is not supported by multi-rank saves yet; each rank stages ~1/N")
        if commit not in MODES:
            raise ValueError(f"commit must be one of {MODES}, got {commit!r}")
        with self._lock:
            self.wait()
            # every rank makes the same saves in the same order, so this count names the save on all ranks
            seq = next(_SAVE_COUNT)
            coord = Coordinator.for_group(self.process_group)
            # marker mode: each node passes its own local path, which must not split the key space
            tag = hashlib.sha256(os.path.abspath(os.fspath(path)).encode()).hexdigest()[:12] \
                if commit == "rename" else "marker"
            sess = coord.session(f"save{seq}-{tag}", timeout_s)
            fut = _start(coord, sess, state, Path(os.path.abspath(os.fspath(path))), opts, tuple(local_keys), commit)
            self._pending = fut
            return fut


def _check_all(infos: list[dict], what: str, exc: BaseException | None) -> None:
    failures = {r: i["error"] for r, i in enumerate(infos) if not i["ok"]}
    if failures:
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
        raise DistributedSaveError(f"multi-rank save failed while {what}, nothing was written: {lines}",
                                   failures) from exc


def _start(coord: Coordinator, sess: Session, state: Any, path: Path, opts: SaveOptions,
           local_keys: tuple[str, ...], mode: str) -> SaveFuture:
    t0 = time.perf_counter()
    rank, world = coord.rank, coord.world_size
    prep, exc = None, None
    try:
        if path.exists() and not opts.overwrite and (mode == "rename" or rank == 0):
            raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
        prep = _prepare(state, opts, local_keys, rank)
    except Exception as e:
        exc = e
    infos = sess.all_gather("prep", {"ok": exc is None, "error": exc and _fmt(exc), "node": coord.node,
                                     "digest": prep and prep.digest,
                                     "local_bytes": prep and prep.loc_plan.file_bytes}, "planning")
    for r, i in enumerate(infos):
        if i["ok"] and infos[0]["ok"] and i["digest"] != infos[0]["digest"]:
            i.update(ok=False, error="replicated state (keys, dtypes, shapes) differs from rank 0's; put "
                                     "per-rank values under local_keys or wrap them in Shard")
    _check_all(infos, "planning", exc)
    nodes = list(dict.fromkeys(i["node"] for i in infos)) if mode == "marker" else [coord.node]
    group = [r for r in range(world) if mode == "rename" or infos[r]["node"] == coord.node]
    runs = dict(zip(group, partition_units(prep.plan, len(group))))
    leader = rank == group[0]
    folder, exc = None, None
    try:
        if leader:
            folder = _create_folder(path, prep, opts, mode, sum(infos[r]["local_bytes"] for r in group))
    except Exception as e:
        exc = e
    opened = sess.all_gather("open", {"ok": exc is None, "error": exc and _fmt(exc), "folder": folder},
                             "creating the folder")
    try:
        _check_all(opened, "creating the folder", exc)
    except DistributedSaveError:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    folder = opened[group[0]]["folder"]
    job = _RankJob(prep, folder, runs[rank], leader, opts)
    stage_exc = None
    try:
        job.open()
        job.stage(prep.rep.sources, prep.loc.sources)
    except Exception as e:
        stage_exc = e
    fut = SaveFuture(path)
    fut._staged.set()  # every rank copied its part at the call
    fut.blocking_s = time.perf_counter() - t0
    ctx = dict(coord=coord, sess=sess, job=job, prep=prep, path=path, opts=opts, folder=folder, mode=mode,
               group=group, runs=runs, nodes=nodes, local_keys=local_keys, fut=fut, t0=t0, stage_exc=stage_exc)
    threading.Thread(target=_finish, kwargs=ctx, name="fastckpt-dist-commit", daemon=False).start()
    return fut


def _finish(*, coord, sess, job, prep, path, opts, folder, mode, group, runs, nodes, local_keys, fut, t0,
            stage_exc) -> None:
    rank, own = coord.rank, stage_exc
    report: dict = {"ok": False, "error": stage_exc and _fmt(stage_exc)}
    if own is None:
        try:
            hashes = job.write()
            report = _rank_report(prep, rank, hashes, folder, job.bytes_written)
        except BaseException as e:  # reported to every rank, re-raised from result()
            own, report = e, {"ok": False, "error": _fmt(e)}
    job.close()
    exc: BaseException | None = None
    rollback = False
    try:
        sess.publish(f"done/{rank}", report)
        if rank == 0:
            _decide(sess, coord, prep, path, opts, folder, mode, runs, nodes, local_keys, fut)
        elif mode == "marker" and rank == group[0]:
            _node_commit(sess, coord, prep, opts, folder, group, runs, nodes, local_keys)
        outcome = sess.wait_for(["commit"], "waiting for rank 0's commit")[0]
        # rank 0 wrote no marker: this node's marker (if any) names an uncommitted step, remove it
        rollback = not outcome["ok"] and not outcome.get("committed", False)
        if not outcome["ok"]:
            failures = {int(r): e for r, e in outcome["failures"].items()}
            lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            raise DistributedSaveError(f"multi-rank save of {path} failed: {lines}",
                                       failures) from own
        fut.total_s = time.perf_counter() - t0
        fut.bytes_written = job.bytes_written
    except BaseException as e:
        exc = e
        if mode == "marker" and rank == group[0] and (rollback or not os.path.exists(os.path.join(folder, cm.MANIFEST))):
            shutil.rmtree(folder, ignore_errors=True)
    fut._finish(exc)


def make_saver(process_group: Any = None):
    """The saver for ``process_group``: a :class:`DistSaver` when the group has several ranks,
    else a plain :class:`fastckpt.saving.saver.Saver` (``None`` with torch.distributed not initialized,
    or :data:`fastckpt.coordination.LOCAL`)."""
    from .saver import Saver
    if Coordinator.for_group(process_group).is_single:
        return Saver()
    return DistSaver(process_group)


def is_multi_rank(process_group: Any = None) -> bool:
    """True when a save with ``process_group`` involves more than this process."""
    return not Coordinator.for_group(process_group).is_single
