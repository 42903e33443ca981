"""save / async_save: ONE engine for one rank or many: collect -> plan -> stage -> write -> commit.

A save of one process is the one-rank case of the same steps; its coordination calls are
plain calls (as in DCP, whose coordination is a no-op in one process). A save is multi-rank
only when ``process_group`` names a group of several ranks: every rank of that group must
make the call. Call order of one save, on every rank of its group:

1. caller thread: validate the options and the state, collect and plan (pure). Multi-rank:
   store all-gather of ``prep`` (errors, a digest of the replicated state, each rank's local
   specs, so every rank builds the same global plan); any error -> every rank raises
   :class:`~fastckpt.errors.DistributedSaveError` before a file exists.
2. caller thread, the folder leader (rank 0, or each node's first rank with ``commit="marker"``):
   hard-link unchanged files (``link_from``), create the folder and every file; all-gather ``open``.
3. caller thread: open the files holding this rank's write units; copy its tensors into the
   saver's staging pool (a ring of slots when ``staging_bytes`` is smaller); the call returns.
4. background thread: deferred copies, ``pwrite`` of this rank's units, checksums of the
   tensors whose first byte it wrote, headers (leader), fsync; its report (``done/{rank}``).
5. background thread, rank 0: with every report, the side files, ``manifest.json`` last,
   one ``rename`` (the commit), ``on_commit``; publishes the outcome (``commit``). Any failure
   removes the folder: nothing partial is ever committed. ``SaveFuture.result()`` returns
   the path or raises (multi-rank: ``DistributedSaveError`` naming each failed rank).

A state holding DTensors (FSDP2, tensor parallel; :func:`save_route`) takes the same steps on
every rank of the DTensors' device meshes (or of ``process_group``): collected once with each
DTensor standing in by its global shape, one exchange of each rank's chunks, the same plan on
every rank, one writer per chunk (:func:`fastckpt.saving.pages.assign_writers`); at the call
each rank copies its chunks straight into the pages it writes in the staging pool (one host
copy), the head bytes of pages another rank writes travel through the store
(:mod:`fastckpt.saving.pages`), and the manifest records a checksum per chunk.

Without ``process_group`` a call saves from this process alone even when torch.distributed
is initialized (``if rank == 0: fastckpt.save(...)``); plain calls from several ranks for one
path fail at once with :class:`~fastckpt.errors.SaveConflictError`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import threading
import time

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..coordination import LOCAL, Coordinator, PathClaim, forget_session, group_timeout_s, numbered_session, path_tag
from ..errors import DistributedSaveError, InvalidArgumentError
from ..format.layout import SavePlan, plan_save
from ..format.stateful import to_state_dicts
from ..storage.staging import StagingPool
from ..storage.store import LOCAL as LOCAL_STORE, strategy
from .remote import start_remote_save, wants_store
from . import dedupe
from .agree import CHECK_BYTES, array_digest, check_agreement, combined, json_leaves
from .collect import Collected, check_weight_keys, collect
from .dtensor import (check_state, has_dtensor, leads_dtensor_save, mesh_coordinator, mesh_ranks, placement_of,
                      refuse_local_dtensors, with_stand_ins)
from .pages import PageJob, assign_writers, check_tiling, create_files
from .committer import (InFlight, check_target, commit_single, create_folder, failed_report, finish_ranks, fmt, rank_report,
                        remove_uncommitted)
from .future import SaveFuture
from .job import Part, SaveJob
from .options import SaveOptions
from .ranks import (RANK_KEY, Ownership, global_plan, has_split, rank_specs, spec_list, specs_from_list,
                    split_state)

#: Sentinel: "the saver's own process group".
_OWN = object()


#: :class:`SaveOptions` keyword names a save of a state holding DTensors refuses (``commit`` only as
#: ``"marker"``): the one list; integrations drop them through :meth:`SaveRoute.drop`.
DTENSOR_REFUSED = ("commit", "link_from", "defer", "defer_frozen", "staging_bytes")


@dataclass(frozen=True)
class SaveRoute:
    """How :meth:`Saver.async_save` saves a state: the route and the options it refuses.

    Get it from :func:`save_route`; the saver decides with the same function, so callers
    (``CheckpointManager``, integrations) never re-detect DTensors nor keep their own lists.

    Attributes:
        dtensor: the state holds DTensors (FSDP2, tensor parallel): every rank of the DTensors'
            device meshes (or of ``process_group``) saves it together, each writing its own chunks.
        refused: :class:`SaveOptions` keyword names this route refuses (empty for plain states).
    """

    dtensor: bool
    refused: tuple[str, ...] = ()

    def drop(self, options: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``options`` (keyword arguments of a save) without the ones this route refuses."""
        return {k: v for k, v in options.items() if k not in self.refused}

    def check(self, opts: SaveOptions) -> None:
        """Refuse the options this route does not support (before any file exists).

        Raises:
            InvalidArgumentError: (a ``ValueError``) naming every refused option that is set, and
                saying to drop them.
        """
        if not self.dtensor:
            return
        c = opts.consistency
        bad = [n for n, on in (("commit='marker'", strategy(opts.commit).per_node),
                               ("link_from", c.link_from is not None), ("defer", c.defer is not None),
                               ("defer_frozen", c.defer_frozen), ("staging_bytes", opts.io.staging_bytes is not None))
               if on]
        if bad:
            raise InvalidArgumentError(f"save options {bad} are not supported for states holding DTensors (FSDP2 / tensor "
                             "parallel) yet; drop them. Nothing was written")

    def leads(self, state: Any) -> bool:
        """True on the rank that commits the save of ``state`` (and keeps a run root's bookkeeping): for a
        DTensor state the lowest global rank of its device meshes; for a plain state, always.

        Raises:
            UnsupportedValueError: a value DTensor saves refuse (see :func:`fastckpt.saving.dtensor.check_state`).
        """
        return leads_dtensor_save(state) if self.dtensor else True


def save_route(state: Any) -> SaveRoute:
    """The route :meth:`Saver.async_save` takes for ``state`` (the one place that decides it).

    Cheap and import-free: a state cannot hold a DTensor unless ``torch.distributed.tensor`` is
    already imported, so a plain state is never walked for DTensors in a process that has none
    and that module is never imported to find out.

    Args:
        state: the state to save (nested dict/list/tuple; ``Stateful`` values as their ``state_dict()``).
    """
    if has_dtensor(state):
        return SaveRoute(True, DTENSOR_REFUSED)
    return _PLAIN


_PLAIN = SaveRoute(False)

def _session_tag(path: Path, opts: SaveOptions) -> str:
    return strategy(opts.commit).session_tag(path, path_tag)  # marker: a path per node


def _check_all(infos: list[dict], what: str, exc: BaseException | None) -> None:
    failures = {r: i["error"] for r, i in enumerate(infos) if not i["ok"]}
    if failures:
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
        raise DistributedSaveError(f"multi-rank save failed while {what}, nothing was written: {lines}",
                                   failures) from exc


def _structure_digest(col: Collected) -> str:
    """The replicated state's structure (key paths, dtypes, shapes), not its values (:func:`_values`)."""
    desc = json.dumps([sorted(json_leaves(col.skeleton)), [(s.key, s.dtype, list(s.shape)) for s in col.specs]])
    return hashlib.sha256(desc.encode()).hexdigest()


def _values(col: Collected, sources: dict | None = None, skip: set[str] = frozenset()) -> dict[str, str]:
    """Digests of the replicated values every rank compares (:mod:`fastckpt.saving.agree`): every JSON
    leaf, and every tensor of at most ``CHECK_BYTES`` (hashed here, at the call) of ``sources``
    (default ``col.sources``) outside ``skip`` (DTensors: each rank holds its own chunks)."""
    out = json_leaves(col.skeleton)
    src = col.sources if sources is None else sources
    out.update((k, array_digest(t)) for k, t in src.items()
               if k not in skip and k in col.sources and t.numel() * t.element_size() <= CHECK_BYTES)
    return out


@contextlib.contextmanager
def no_gc():
    """Defer Python's cyclic garbage collector for the caller's blocking part of a save.

    Walking a large state allocates thousands of small objects; in a process holding a model
    (~450k tracked objects with transformers loaded) the collections they trigger cost more
    than the walk itself (collect: 24 ms with, 8 ms without, SmolLM2 + LoRA + AdamW state).
    Nothing is leaked: collection resumes, as it was, on exit.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Saver:
    """Runs saves, one at a time, from a reusable staging pool (bounded staging memory).

    The one engine of fastckpt: :func:`fastckpt.async_save` uses a process-wide default
    ``Saver``; each :class:`~fastckpt.CheckpointManager`, Trainer callback and accelerate
    plugin owns its own, so a failure surfaces only in the calls of the object whose save failed.

    Args:
        process_group: default ``process_group`` of this saver's saves (``None``: each save
            runs in the calling process alone unless the call passes one).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.pool = StagingPool()
        self.hash_cache = dedupe.HashCache()  # for link_check="version"
        self._plan_memo: tuple[tuple, SavePlan] | None = None  # last (inputs, plan): saves repeat
        self._pending: SaveFuture | None = None
        self._priming: threading.Thread | None = None  # prime_hashes in the background
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        """This process's rank in the saver's process group (0 for saves of one process)."""
        if self.process_group is None:
            return 0
        return Coordinator.for_group(self.process_group).rank

    def reserve(self, nbytes: int, *, background: bool = True, pinned: bool | None = None) -> None:
        """Pre-allocate and fault in ``nbytes`` of staging memory (e.g. at train begin).

        Args:
            nbytes: bytes to reserve (the expected state size).
            background: do it in a thread (default; the interpreter waits for it at exit); a save
                that starts meanwhile waits for it, never does the work twice.
            pinned: page-lock the buffer, as a save of CUDA tensors needs (page-locking costs
                about 0.3-1 s per GiB, once). ``None`` (default): where a CUDA device is present.
                A save of CPU tensors uses a page-locked buffer as it is; a save of CUDA tensors
                replaces one of ordinary pages.

        Raises:
            InvalidArgumentError: ``nbytes`` is not an ``int`` >= 0 (at the call, also with ``background``).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgumentError(f"reserve: nbytes must be an int >= 0 (bytes of staging memory, e.g. the "
                                       f"state's size), got {type(nbytes).__name__} {nbytes!r:.80}")
        import torch
        pin = torch.cuda.is_available() if pinned is None else bool(pinned)
        if background:
            # not a daemon: the interpreter waits for it at exit (seconds at most). A daemon thread
            # still inside its torch op while libtorch's static destructors run aborted the process
            # (SIGABRT, rc 134) when a train() failed before the first save (a Trainer differential probe).
            threading.Thread(target=self.pool.reserve, args=(nbytes, pin), name="fastckpt-reserve").start()
        else:
            self.pool.reserve(nbytes, pin)

    def prime_hashes(self, state: Any, *, weights: dict[str, str] | None = None,
                     background: bool = True) -> int:
        """Hash the frozen parameters of ``state`` now, for later saves with ``link_check="version"``.

        Every value of ``state`` that is a ``torch.nn.Parameter`` with ``requires_grad=False``
        (contiguous, CPU) is hashed with xxh3-64 and recorded in :attr:`hash_cache` under its key
        path, with its storage and version counter taken *before* hashing (a torch in-place
        write meanwhile makes the record stale; one bypassing the counter is caught by the save
        that uses the record). A later save of the same key paths then links these tensors
        (``link_from``) or, with ``defer_frozen=True``, copies them in the background, without
        hashing them at the call: call it at train begin, e.g. after loading or resuming.

        Args:
            state: the state, or the part of it holding the frozen parameters, with the key
                paths the saves will use (same nesting, same ``weights`` mapping).
            weights: as :class:`SaveOptions` (default ``{"model": "model"}``).
            background: hash in a thread (default; the interpreter waits for it at exit); a save that starts meanwhile waits for it.

        Returns:
            Number of bytes that will be hashed.

        Raises:
            UnsupportedValueError / UnsupportedDtypeError: as :func:`fastckpt.async_save`.
        """
        with no_gc():
            col = collect(state, weights if weights is not None else {"model": "model"})
        todo = [(k, col.sources[k]) for k in sorted(col.frozen)
                if dedupe.HashCache.ident(col.sources[k]) is not None]
        cache = self.hash_cache

        def run() -> None:
            for k, t in todo:
                ident = dedupe.HashCache.ident(t)
                cache.record(k, ident, dedupe.source_hash(t))

        self._join_priming()
        if background:
            self._priming = threading.Thread(target=run, name="fastckpt-prime")  # not a daemon: as reserve's
            self._priming.start()
        else:
            run()
        return sum(t.numel() * t.element_size() for _, t in todo)

    def _join_priming(self) -> None:
        th, self._priming = self._priming, None
        if th is not None:
            th.join()

    def wait(self) -> None:
        """Wait for the pending save; re-raise its failure if nobody collected it yet."""
        fut = self._pending
        if fut is None:
            return
        fut._event.wait()
        self._pending = None
        if fut._exc is not None and not fut._collected:
            fut.result()

    def async_save(self, state: Any, path: str | os.PathLike, *, process_group: Any = _OWN,
                   **options: Any) -> SaveFuture:
        """See :func:`fastckpt.async_save` (``process_group`` defaults to the saver's own)."""
        return self._submit(state, path, process_group, options, direct=False)

    def save(self, state: Any, path: str | os.PathLike, *, process_group: Any = _OWN, **options: Any) -> Path:
        """See :func:`fastckpt.save` (``process_group`` defaults to the saver's own): ``async_save(...).result()``,
        except that a state of CPU tensors saved by this process alone is written straight from the
        tensors' memory, never copied into the staging pool (:mod:`fastckpt.saving.direct`), since the
        caller waits for the whole save anyway. Returns the checkpoint's path."""
        return self._submit(state, path, process_group, options, direct=True).result()

    def _submit(self, state: Any, path: str | os.PathLike, process_group: Any, options: dict[str, Any], *,
                direct: bool) -> SaveFuture:
        if wants_store(path, options):  # s3://... or store=: spool locally, upload with the store's commit
            return start_remote_save(self, state, path, self.process_group if process_group is _OWN else process_group, options)
        opts = SaveOptions(**options)
        opts.check()
        pg = self.process_group if process_group is _OWN else process_group
        with self._lock:
            self.wait()
            state, _ = to_state_dicts(state)  # top-level Stateful objects: their state_dict(), as DCP saves them
            target = Path(os.path.abspath(InvalidArgumentError.check_path(path)))
            route = save_route(state)
            with no_gc():
                return self._start(state, target, opts, pg, route, direct)

    def _plan(self, specs: list, opts: SaveOptions) -> SavePlan:
        """:func:`plan_save`, memoised on its inputs (a training run saves the same layout each time)."""
        key = (tuple(specs), opts.io.max_shard_bytes, opts.io.chunk_bytes, tuple(sorted((opts.metadata or {}).items())))
        memo = self._plan_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        plan = plan_save(specs, max_shard_bytes=opts.io.max_shard_bytes, chunk_bytes=opts.io.chunk_bytes,
                         metadata=opts.metadata)
        self._plan_memo = (key, plan)
        return plan

    def _start(self, state: Any, path: Path, opts: SaveOptions, pg: Any, route: SaveRoute,
               direct: bool = False) -> SaveFuture:
        t0 = time.perf_counter()
        self._join_priming()
        if route.dtensor:  # every rank of the DTensors' meshes (or of process_group) saves together
            meshes = check_state(state)  # the state's structure: alike on every rank
            coord = mesh_coordinator(pg, mesh_ranks(meshes))
        else:
            single = pg is None or (isinstance(pg, str) and pg == LOCAL)
            coord = Coordinator.single() if single else Coordinator.for_group(pg)
        timeout = opts.timeout_s if opts.timeout_s is not None else group_timeout_s(pg)
        name = "save" if coord.is_single else numbered_session(coord, "save", _session_tag(path, opts))
        sv = InFlight(coord, coord.session(name, timeout), path, opts, SaveFuture(path), t0)
        try:
            if route.dtensor:
                self._prepare_chunks(sv, state, route)
                self._stage_chunks(sv, direct)
            else:
                self._prepare(sv, state)
                self._open(sv)
                self._stage(sv, direct)
        except BaseException:
            self._abort(sv)
            raise
        fut = sv.fut
        fut._staged = sv.job.staged
        if not sv.job.deferred and not getattr(sv.job, "direct", False):  # direct: set once every write is done
            sv.job.staged.set()
        fut.blocking_s = time.perf_counter() - t0
        self._pending = fut
        fut._start()
        threading.Thread(target=self._finish, args=(sv,), name="fastckpt-commit", daemon=False).start()
        return fut

    def _abort(self, sv: InFlight) -> None:
        """Undo a save that failed during the call: nothing held, nothing left on disk."""
        if sv.job is not None:
            sv.job.close()
        if sv.part.leader:
            remove_uncommitted(sv.folder, sv.opts)
        if sv.claim is not None:
            sv.claim.release()
        if sv.sess.incomplete:  # some rank never joined: a retry of the same path must start clean
            sv.sess.abandon()
            forget_session(sv.coord, "save", _session_tag(sv.path, sv.opts))
        else:
            sv.sess.close()

    def _prepare(self, sv: InFlight, state: Any) -> None:
        """Step 1: validate, collect and plan; multi-rank: agree on the global plan."""
        opts, coord, exc, values = sv.opts, sv.coord, None, {}
        try:
            if not strategy(opts.commit).per_node or coord.rank == 0:
                hint = ("" if opts.overwrite or not sv.single or not LOCAL_STORE.lexists(str(sv.path))
                        or PathClaim(sv.path).store is None else
                        " (if every rank saves this checkpoint together, pass process_group= on every rank)")
                check_target(sv.path, opts.overwrite, hint=hint)
            if sv.single:
                sv.claim = PathClaim(sv.path)
                sv.claim.acquire()
            check_weight_keys(state, opts.weights)
            split = split_state(state, opts.local_keys) if has_split(state, opts.local_keys) else None
            sv.col = collect(split.replicated if split else state, opts.stems)
            sv.sources, sv.frozen, sv.trainable = sv.col.sources, sv.col.frozen, sv.col.trainable
            loc_specs = self._collect_local(sv, split) if split else []
            if sv.single:
                if split is None:
                    sv.plan = self._plan(sv.col.specs, opts)
                    return
                io = opts.io  # local keys in one process: the one-rank case of their layout
                sv.plan = global_plan(sv.col.specs, [loc_specs], max_shard_bytes=io.max_shard_bytes,
                                      chunk_bytes=io.chunk_bytes, metadata=opts.metadata)
                sv.nodes, sv.own = [coord.node], Ownership.of(sv.plan, [0], 1)
                return
            values = _values(sv.col)
        except Exception as e:
            if sv.single:
                raise
            exc = e
        infos = sv.sess.all_gather("prep", {"ok": exc is None, "error": exc and fmt(exc), "node": coord.node,
                                            "digest": exc is None and _structure_digest(sv.col),
                                            "values": exc is None and combined(values),
                                            "local": [] if exc is not None else spec_list(loc_specs)}, "planning")
        for i in infos:
            if i["ok"] and infos[0]["ok"] and i["digest"] != infos[0]["digest"]:
                i.update(ok=False, error="replicated state (keys, dtypes, shapes) differs from rank 0's; put "
                                         "per-rank values under local_keys or save DTensors")
        _check_all(infos, "planning", exc)
        check_agreement(sv.sess, values, [i["values"] for i in infos], sv.path, "comparing the replicated values")
        io = opts.io
        sv.plan = global_plan(sv.col.specs, [specs_from_list(i["local"]) for i in infos],
                              max_shard_bytes=io.max_shard_bytes, chunk_bytes=io.chunk_bytes, metadata=opts.metadata)
        marker = strategy(opts.commit).per_node
        sv.nodes = list(dict.fromkeys(i["node"] for i in infos)) if marker else [coord.node]
        group = [r for r in range(coord.world_size) if not marker or infos[r]["node"] == coord.node]
        sv.own = Ownership.of(sv.plan, group, coord.world_size)
        sv.part = Part(sv.own.units[coord.rank], sv.own.files, leader=coord.rank == group[0])

    def _prepare_chunks(self, sv: InFlight, state: Any, route: SaveRoute) -> None:
        """Step 1 of a state holding DTensors: validate and collect once (DTensors by global shape), each
        rank's chunks (``DTensor.__create_chunk_list__``, as DCP's planner takes them), one exchange; then
        every rank builds the same plan and the same writer of every chunk (:func:`assign_writers`)."""
        opts, coord, exc = sv.opts, sv.coord, None
        values: dict[str, str] = {}
        held: list[list] = []
        loc_specs: list = []
        try:
            route.check(opts)
            check_weight_keys(state, opts.weights)
            check_target(sv.path, opts.overwrite)
            split = split_state(state, opts.local_keys) if has_split(state, opts.local_keys) else None
            if split is not None:
                refuse_local_dtensors(split.local)
            sub, found = with_stand_ins(split.replicated if split else state)
            sv.col = collect(sub, opts.stems)
            dts = {k for k, v in found.items() if hasattr(v, "placements")}
            sv.sources = {s.key: (found[s.key].to_local() if s.key in dts else found[s.key].detach())
                          if s.key in found else sv.col.sources[s.key] for s in sv.col.specs}
            loc_specs = self._collect_local(sv, split) if split else []
            for s in sv.col.specs:
                if s.key in dts:
                    held += [[s.key, list(c.offsets), list(c.sizes)] for c in found[s.key].__create_chunk_list__()]
                else:
                    held.append([s.key, [0] * len(s.shape), list(s.shape)])
            held += [[s.key, [0] * len(s.shape), list(s.shape)] for s in loc_specs]
            sv.placement = {k: placement_of(found[k]) for k in dts}
            values = _values(sv.col, sv.sources, skip=dts)
        except Exception as e:
            exc = e
        infos = sv.sess.all_gather("prep", {"ok": exc is None, "error": exc and fmt(exc), "node": coord.node,
                                            "digest": exc is None and _structure_digest(sv.col),
                                            "values": exc is None and combined(values),
                                            "local": [] if exc is not None else spec_list(loc_specs),
                                            "chunks": held}, "planning")
        for i in infos:
            if i["ok"] and infos[0]["ok"] and i["digest"] != infos[0]["digest"]:
                i.update(ok=False, error="state (keys, dtypes, shapes; DTensors by global shape) differs from rank "
                                         "0's; every rank must save the same state (per-rank values under local_keys)")
        if exc is not None:
            raise exc  # this rank's own error, its own type; the others name it (DistributedSaveError)
        _check_all(infos, "planning", exc)
        check_agreement(sv.sess, values, [i["values"] for i in infos], sv.path, "comparing the values stored once")
        io = opts.io
        sv.plan = global_plan(sv.col.specs, [specs_from_list(i["local"]) for i in infos],
                              max_shard_bytes=io.max_shard_bytes, chunk_bytes=io.chunk_bytes, metadata=opts.metadata)
        chunks = assign_writers([i["chunks"] for i in infos])
        check_tiling(sv.plan, chunks)
        sv.nodes = [coord.node]
        sv.own = Ownership(tuple(range(coord.world_size)), {}, tuple(range(len(sv.plan.files))))
        sv.part = Part((), None, leader=coord.rank == 0)
        sv.job = PageJob(sv.plan, chunks, coord.rank, None, opts, self.pool, sv.sess)

    def _stage_chunks(self, sv: InFlight, direct: bool = False) -> None:
        """Steps 2-3 of a state holding DTensors: copy this rank's chunks straight into the pages it writes
        (one host copy), the leader creates the folder and every file; one exchange tells every rank
        whether every rank got there (a rank's own failure raises its own error there).

        ``direct`` (a blocking save): where the files take no O_DIRECT writes anyway (a memory-backed
        tier, or ``o_direct=False``) and the rank's chunks allow it
        (:meth:`~fastckpt.saving.pages.PageJob.can_write_direct`), nothing is copied: they are written
        from the tensors' own memory."""
        exc = None
        try:
            sv.job.stage(sv.sources, direct=direct and sv.job.can_write_direct(sv.sources, str(sv.path)))
            if sv.part.leader:
                sv.folder = create_folder(sv.path, sv.opts, sv.plan.file_bytes, [f.name for f in sv.plan.files])
                sv.header_bytes = create_files(sv.plan, sv.folder, sv.opts)
        except Exception as e:
            exc = e
        opened = sv.sess.all_gather("open", {"ok": exc is None, "error": exc and fmt(exc), "folder": sv.folder},
                                    "staging and creating the folder")
        if exc is not None:
            raise exc
        _check_all(opened, "staging and creating the folder", exc)
        sv.folder = sv.job.folder = opened[0]["folder"]

    def _write_chunks(self, sv: InFlight) -> dict:
        """Step 4 of a state holding DTensors (background): edges, writes, checksums; returns the report."""
        job = sv.job
        try:
            job.send_edges()
            job.write()
            hashes = job.hashes()
        except BaseException as e:
            job.fail_edges(e)
            raise
        shapes = {t.spec.key: t.spec.shape for f in sv.plan.files for t in f.tensors}
        whole: dict[str, str] = {}
        pieces: dict[str, list[dict]] = {}
        for ci, h in hashes.items():
            c = job.chunks[ci]
            if c.shape == tuple(shapes[c.key]) and not any(c.offsets):
                whole[c.key] = h
            else:
                pieces.setdefault(c.key, []).append({"offsets": list(c.offsets), "shape": list(c.shape), "xxh3": h})
        report = rank_report(sv.coord.rank, whole, sv.local, sv.folder, job.bytes_written + sv.header_bytes, 0)
        report.update(chunks=pieces, placement=sv.placement,
                      written=sorted({sv.plan.files[fi].name for fi, _, _, _ in job.lay.spans}))
        return report

    @staticmethod
    def _collect_local(sv: InFlight, split) -> list:
        """Collect this rank's local state under :data:`RANK_KEY` keys; returns its specs."""
        loc = collect(split.local, {})
        pre = RANK_KEY.format(sv.coord.rank)
        sv.sources = {**sv.sources, **{pre + k: t for k, t in loc.sources.items()}}
        sv.frozen = sv.frozen | {pre + k for k in loc.frozen}
        sv.trainable = sv.trainable | {pre + k for k in loc.trainable}
        entries = {}
        for k, e in loc.entries.items():
            e = dict(e)
            for ref in ("alias", "view"):
                if ref in e:
                    e[ref] = pre + e[ref]
            entries[pre + k] = e
        sv.local = (loc.skeleton, entries)  # JSON values alone (a sample counter) need their skeleton too
        return rank_specs(loc.specs, sv.coord.rank)

    def _open(self, sv: InFlight) -> None:
        """Step 2: the leader links unchanged files, creates the folder and the files."""
        opts, exc = sv.opts, None
        job = sv.job = SaveJob(sv.plan, "", opts, self.pool, self.hash_cache, sv.part)
        if sv.part.leader:
            try:
                here = sv.own.files if sv.own is not None else range(len(sv.plan.files))
                sv.folder = job.tmp = create_folder(sv.path, opts, sum(sv.plan.files[i].size for i in here),
                                                    [sv.plan.files[i].name for i in here])
                if opts.consistency.link_from is not None:
                    job.link_unchanged(Collected(None, sources=sv.sources, frozen=sv.frozen, trainable=sv.trainable))
                job.open_files()
            except Exception as e:
                if sv.single:
                    raise
                exc = e
        if sv.single:
            return
        opened = sv.sess.all_gather("open", {"ok": exc is None, "error": exc and fmt(exc), "folder": sv.folder,
                                             "linked": sorted(job.linked) if exc is None else []},
                                    "creating the folder")
        _check_all(opened, "creating the folder", exc)
        lead = opened[sv.own.group[0]]
        sv.folder = job.tmp = lead["folder"]
        job.linked = set(lead["linked"])

    def _stage(self, sv: InFlight, direct: bool = False) -> None:
        """Step 3: open this rank's files, copy its tensors into staging memory (``direct``, a blocking
        save of one process whose tensors allow it: start writing them from their own memory instead)."""
        try:
            if not sv.part.leader:
                sv.job.open_files()
            if direct and sv.single and sv.job.can_write_direct(sv.sources):
                sv.job.write_direct(sv.sources, sv.frozen)
            else:
                sv.job.stage(sv.sources, sv.frozen, sv.trainable)
        except Exception as e:
            if sv.single:
                raise
            sv.stage_exc = e  # reported to every rank from the background, which fails them all

    def _finish(self, sv: InFlight) -> None:
        """Steps 4-5, in the background thread."""
        job, own, report = sv.job, sv.stage_exc, None
        if own is None and isinstance(job, PageJob):
            try:
                report = self._write_chunks(sv)
            except BaseException as e:
                own = e
        elif own is None:
            try:
                job.start_verify()
                job.write_all()
                job.verify_links()
                job.record_hashes()
                job.close(strict=True)
                linked = sum(sv.plan.files[i].size for i in job.linked)
                report = rank_report(sv.coord.rank, {k: v for k, v in job.hashes.items() if isinstance(v, str)},
                                     sv.local, sv.folder, job.bytes_written, linked)
            except BaseException as e:  # re-raised by result(), never swallowed
                own = e
        job.close()
        exc: BaseException | None = None
        try:
            if sv.single:
                if own is not None:
                    raise own
                commit_single(sv, report)
            else:
                finish_ranks(sv, report or failed_report(own), own)
        except BaseException as e:
            exc = e
            if sv.part.leader:
                remove_uncommitted(sv.folder, sv.opts)
        finally:
            if sv.claim is not None:
                sv.claim.release()
            sv.sess.close()
        sv.fut._finish(exc)  # also sets fut._staged: a failed save never leaves a waiter hanging
