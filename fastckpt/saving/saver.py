"""save / async_save: stage, write in parallel, commit atomically.

One save path: :func:`save` is ``async_save(...).result()``. Call order of one save:

1. caller thread: validate the state and options, plan (pure), check free space,
   create the hidden temporary folder and the files, copy every tensor into the staging
   buffer (this is all the caller waits for, unless the staging budget is smaller than
   the state, in which case writes stream out of a ring of slots while copying);
2. background thread (:mod:`fastckpt.saving.job`): parallel ``pwrite`` of write units + per-tensor xxh3 checksums on a
   thread pool, headers, fsync of every file, JSON files, ``manifest.json`` last, fsync of
   the folder, one ``rename`` (the commit), retention hooks;
3. ``SaveFuture.result()`` returns the path or raises the background error itself.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..storage import commit as cm
from . import dedupe
from .collect import collect
from .metadata import manifest_doc, tensor_entries, write_manifest, write_side_files
from ..errors import CheckpointExistsError, InsufficientSpaceError
from ..format.safetensors import check_metadata
from ..storage.io import PosixBackend
from ..format.layout import SavePlan, plan_save
from .job import _Job
from ..storage.io import DEFAULT_CHUNK_BYTES, default_threads
from ..storage.staging import StagingPool

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000


@dataclass
class SaveOptions:
    """Options of :func:`save` / :func:`async_save` (all keyword-only there).

    Attributes:
        overwrite: replace an existing ``path`` atomically (default ``False``: refuse).
        weights: top-level state key -> HF file stem (default ``{"model": "model"}``). Tensors
            directly under that key are written with their own names as
            ``{stem}-0000k-of-0000n.safetensors`` + ``{stem}.safetensors.index.json``; a stem
            ending in ``.safetensors`` is one file of exactly that name.
        extra_files: file name -> bytes, small files committed with the checkpoint.
        metadata: ``str -> str`` stored in every shard's ``__metadata__``.
        step: training step recorded in the manifest (``int`` or ``None``).
        max_shard_bytes: data bytes per shard file (default 5e9, as HF).
        chunk_bytes: bytes per write request (default 8 MiB; multiple of 4096).
        threads: parallel I/O threads (default :func:`default_threads`).
        staging_bytes: staging memory budget in bytes (default: the whole state, so the
            caller is released after one memory copy); smaller budgets stream.
        o_direct: write with O_DIRECT (no page-cache copy: the staged bytes go straight to the
            disk). ``None`` (default): where the file system supports it; ``False``: buffered.
        io_backend: name in :data:`fastckpt.storage.io.BACKENDS` or a backend instance.
        min_free_bytes: extra free bytes required beyond the checkpoint (default 0).
        on_commit: optional callback ``(path)`` run in the writer thread after the commit.
        link_from: a previous committed checkpoint folder (default ``None``). Every shard file
            whose bytes would be identical to the same-named file there (same header, same
            xxh3-64 of every tensor, hashed from the source CPU tensors at the call) is
            hard-linked instead of staged and written; see :mod:`fastckpt.saving.dedupe`. Hashing
            runs at ~10 GB/s, so unchanged frozen weights (LoRA) cost a fraction of a copy.
        early_writes: start writing each staged unit while the caller is still copying (host
            sources, whole-state staging). Lowers the total time of a save (disk and copy
            overlap) but the writes share the cores and memory bandwidth with the copy, so the
            caller blocks longer (first LoRA snapshot of SmolLM2: 0.26 s vs 0.18 s, measured).
            Default ``False`` for :func:`fastckpt.async_save` (training waits only for the copy);
            :func:`fastckpt.save`, whose caller waits for the whole save anyway, turns it on.
        link_check: how ``link_from`` proves a tensor unchanged at the call. ``"hash"``
            (default): xxh3 of every source tensor of a candidate file, in the caller's thread.
            ``"version"``, for states holding the live ``torch.nn.Parameter`` objects: a frozen
            parameter (``requires_grad=False``, CPU) backed by the same storage object, with the
            same dtype/shape/offset and version counter as when this process's saver last
            hashed it, is taken as unchanged without hashing at the call; it is re-hashed in the
            background before the commit, and a mismatch its version counter did not show (a
            write through ``.data`` or a NumPy view) fails the save with
            :class:`~fastckpt.errors.LinkedTensorChangedError`. Files holding a trainable
            parameter are staged without hashing (fused optimizers such as
            ``AdamW(fused=True)`` step parameters without bumping the counter, so it is never
            trusted for them); other tensors are hashed as with ``"hash"``. A frozen parameter
            written in place after the call (counter bumped) is trusted on its version at the call.
        defer_frozen: with ``link_check="version"``, a frozen parameter whose recorded hash its
            version counter still vouches for (see :meth:`Saver.prime_hashes`) is copied into
            staging by the background thread instead of during the call, and its staged bytes
            are checked against that hash before they can be committed. This takes the frozen
            base weights of a LoRA snapshot off the caller's blocking copy when there is no
            previous checkpoint to link them from (the first save of a run). The caller must not
            write those parameters until the save is done: a write is detected (version counter,
            or the hash for writes that bypass it) and fails the save with
            :class:`~fastckpt.errors.LinkedTensorChangedError`, nothing committed. Default ``False``.
        defer: ``(key path, trainable) -> bool`` (default ``None``: none), called for each
            tensor with its key path and whether its value in the state was a trainable
            ``torch.nn.Parameter`` (frozen parameters are never deferred by it, only by
            ``defer_frozen``, which checks them against a hash: writes through ``.data``, as
            peft's merge does, would go unseen). Host tensors it accepts are not copied during the call but by the background thread, in stream order, before
            their writes; :meth:`SaveFuture.wait_staged` returns once they are all copied. The
            caller must not write them until then (e.g. the next optimizer step waits for it:
            the pipelined snapshot of CheckFreq, Mohan et al., FAST 2021). Writing them before
            then breaks this contract; it is detected where it can be: a torch in-place write that
            has finished before the background copy does moves the version counter (checked
            before each copy and after all of them) and fails the save with
            :class:`~fastckpt.errors.SourceChangedError`, nothing committed. A torch write still
            running when the copy ends (its counter moves only when it is done) and writes that
            bypass the counter (``.data``, fused optimizers) are not seen: wait first. The copy runs in a Python thread: it overlaps work that releases the
            GIL (torch ops); a Python-bound caller leaves it little time. Ignored when staging
            streams (``staging_bytes`` below the state size).
    """

    overwrite: bool = False
    weights: dict[str, str] | None = None
    extra_files: dict[str, bytes] | None = None
    metadata: dict[str, str] | None = None
    step: int | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: int | None = None
    staging_bytes: int | None = None
    o_direct: bool | None = None
    io_backend: str | PosixBackend | None = None
    min_free_bytes: int = 0
    on_commit: Callable[[Path], None] | None = field(default=None, repr=False)
    link_from: str | os.PathLike | None = None
    link_check: str = "hash"
    early_writes: bool = False
    defer_frozen: bool = False
    defer: Callable[[str, bool], bool] | None = field(default=None, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        for name in ("max_shard_bytes", "chunk_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int of bytes, got {v!r}")
        if self.chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a multiple of 4096, got {self.chunk_bytes}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")
        if self.staging_bytes is not None and (not isinstance(self.staging_bytes, int) or self.staging_bytes <= 0):
            raise ValueError(f"staging_bytes must be a positive int of bytes, got {self.staging_bytes!r}")
        for n in self.extra_files or {}:
            if "/" in n or n.startswith(".") or n in (cm.MANIFEST, cm.STATE_JSON):
                raise ValueError(f"extra file name {n!r} is reserved or not a plain file name")
        for name in ("early_writes", "defer_frozen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.defer is not None and not callable(self.defer):
            raise ValueError(f"defer must be a callable (key path, trainable) -> bool, got {self.defer!r}")
        if self.link_check not in ("hash", "version"):
            raise ValueError(f"link_check must be 'hash' or 'version', got {self.link_check!r}")
        check_metadata(self.metadata)


#: Failed saves whose error nobody collected yet (warned about at interpreter exit).
_UNCOLLECTED: "set[SaveFuture]" = set()


class SaveFuture:
    """Handle of one asynchronous save.

    Attributes:
        path: the checkpoint folder it commits (``pathlib.Path``).
        blocking_s: seconds the ``async_save`` call blocked (validation + staging).
        total_s: seconds from the call until the commit (``None`` while pending).
        bytes_written: bytes of all files of the checkpoint (set when done), linked ones included.
        bytes_linked: the part of ``bytes_written`` hard-linked from ``link_from`` instead of
            written (0 without ``link_from``).
    """

    def __init__(self, path: Path):
        self.path = path
        self.blocking_s = 0.0
        self.total_s: float | None = None
        self.bytes_written = 0
        self.bytes_linked = 0
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._collected = False
        self._callbacks: list[Callable[["SaveFuture"], None]] | None = []
        self._cb_lock = threading.Lock()
        self._staged = threading.Event()  # every tensor copied out of the caller's memory

    def wait_staged(self, timeout_s: float | None = None) -> bool:
        """Wait until every tensor of the state is copied into staging memory (at once unless
        :class:`SaveOptions` ``defer``/``defer_frozen`` left copies to the background; also
        true once the save failed). After that the caller may write the state's tensors.

        Args:
            timeout_s: seconds to wait (default: forever).

        Returns:
            True when staged, False on timeout.
        """
        return self._staged.wait(timeout_s)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._event.is_set()

    def result(self, timeout_s: float | None = None) -> Path:
        """Wait for the commit and return the checkpoint path.

        Args:
            timeout_s: seconds to wait (default: forever).

        Raises:
            TimeoutError: not done within ``timeout_s``.
            BaseException: the background failure itself (same object, errno kept), on every call.
        """
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"save of {self.path} not finished after {timeout_s} s")
        if self._exc is not None:
            self._collected = True
            _UNCOLLECTED.discard(self)
            raise self._exc
        return self.path

    def exception(self) -> BaseException | None:
        """The background failure, or ``None`` (waits for completion)."""
        self._event.wait()
        return self._exc

    def add_done_callback(self, fn: Callable[["SaveFuture"], None]) -> None:
        """Call ``fn(self)`` once the save committed or failed, before ``result()`` returns.

        Runs in the writer thread (or at once in the caller's thread if already done);
        an exception from ``fn`` is reported as a warning, never replacing the save's outcome.
        """
        with self._cb_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc
        if exc is not None:
            _UNCOLLECTED.add(self)
        with self._cb_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            _run_callback(fn, self)
        self._staged.set()  # done or failed: nothing of the caller's memory is needed any more
        self._event.set()


def _run_callback(fn: Callable[[SaveFuture], None], fut: SaveFuture) -> None:
    try:
        fn(fut)
    except Exception as e:  # a callback must not hide the save's own outcome
        warnings.warn(f"fastckpt: done-callback of the save of {fut.path} failed: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=1)


@atexit.register
def _warn_uncollected() -> None:
    for fut in list(_UNCOLLECTED):
        if not fut._collected:
            warnings.warn(f"fastckpt: a background save of {fut.path} failed and nobody called result(): "
                          f"{type(fut._exc).__name__}: {fut._exc}", RuntimeWarning, stacklevel=1)


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
    """Owns a staging pool and runs at most one save at a time (bounded staging memory).

    :func:`fastckpt.async_save` uses a process-wide default ``Saver``; a
    :class:`~fastckpt.CheckpointManager` owns its own.
    """

    def __init__(self) -> None:
        self.pool = StagingPool()
        self.hash_cache = dedupe.HashCache()  # for link_check="version"
        self._plan_memo: tuple[tuple, SavePlan] | None = None  # last (inputs, plan): saves repeat
        self._pending: SaveFuture | None = None
        self._priming: threading.Thread | None = None  # prime_hashes in the background
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, *, background: bool = True) -> None:
        """Pre-allocate and fault in ``nbytes`` of staging memory (e.g. at train begin).

        Args:
            nbytes: bytes to reserve (the expected state size).
            background: do it in a daemon thread (default); a save that starts meanwhile
                waits for it, never does the work twice.
        """
        if background:
            threading.Thread(target=self.pool.reserve, args=(nbytes,), name="fastckpt-reserve",
                             daemon=True).start()
        else:
            self.pool.reserve(nbytes)

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
            background: hash in a daemon thread (default); a save that starts meanwhile waits for it.

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
            self._priming = threading.Thread(target=run, name="fastckpt-prime", daemon=True)
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

    def async_save(self, state: Any, path: str | os.PathLike, **options: Any) -> SaveFuture:
        """See :func:`fastckpt.async_save`."""
        opts = SaveOptions(**options)
        opts.check()
        with self._lock:
            self.wait()
            with no_gc():
                return self._start(state, Path(os.path.abspath(os.fspath(path))), opts)

    def _plan(self, specs: list, opts: SaveOptions) -> SavePlan:
        """:func:`plan_save`, memoised on its inputs (a training run saves the same layout each time)."""
        key = (tuple(specs), opts.max_shard_bytes, opts.chunk_bytes, tuple(sorted((opts.metadata or {}).items())))
        memo = self._plan_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        plan = plan_save(specs, max_shard_bytes=opts.max_shard_bytes, chunk_bytes=opts.chunk_bytes,
                         metadata=opts.metadata)
        self._plan_memo = (key, plan)
        return plan

    def _start(self, state: Any, path: Path, opts: SaveOptions) -> SaveFuture:
        t0 = time.perf_counter()
        self._join_priming()
        if path.exists() and not opts.overwrite:
            raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it atomically")
        col = collect(state, opts.weights if opts.weights is not None else {"model": "model"})
        plan = self._plan(col.specs, opts)
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_space(path.parent, plan.file_bytes + opts.min_free_bytes)
        tmp = cm.make_temp_dir(str(path))
        job = _Job(plan, tmp, opts, self.pool, self.hash_cache)
        fut = SaveFuture(path)
        fut._staged = job.staged
        try:
            if opts.link_from is not None:
                job.link_unchanged(col)
            job.open_files()
            job.stage(col.sources, col.frozen, col.trainable)
        except BaseException:
            job.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not job.deferred:
            job.staged.set()
        fut.blocking_s = time.perf_counter() - t0
        self._pending = fut
        th = threading.Thread(target=_finish, args=(job, col, path, opts, fut, t0),
                              name="fastckpt-commit", daemon=False)
        th.start()
        return fut


def _finish(job: _Job, col, path: Path, opts: SaveOptions, fut: SaveFuture, t0: float) -> None:
    exc: BaseException | None = None
    try:
        job.start_verify()
        job.write_all()
        job.verify_links()
        job.record_hashes()
        job.close(strict=True)
        fut.bytes_written = _write_metadata(job, col, opts)
        fut.bytes_linked = sum(job.plan.files[i].size for i in job.linked)
        os.unlink(os.path.join(job.tmp, cm.OWNER))
        cm.commit_dir(job.tmp, str(path), overwrite=opts.overwrite)
        fut.total_s = time.perf_counter() - t0
        if opts.on_commit is not None:
            opts.on_commit(path)
    except BaseException as e:  # re-raised by result(), never swallowed
        exc = e
        job.close()
        shutil.rmtree(job.tmp, ignore_errors=True)
    fut._finish(exc)  # also sets fut._staged (= job.staged): a failed save never leaves a waiter hanging


def _write_metadata(job: _Job, col, opts: SaveOptions) -> int:
    """Write state.json, HF index files, extra files and (last) the manifest. Returns bytes of all files."""
    files = write_side_files(job.tmp, job.plan, col.skeleton, opts.extra_files)
    tensors = tensor_entries(job.plan, job.hashes, col.entries)
    return write_manifest(job.tmp, manifest_doc(opts, files, tensors))


def _check_space(folder: Path, need: int) -> None:
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise InsufficientSpaceError(
            f"{folder}: {free} bytes free, the checkpoint needs {need} bytes; free space or save elsewhere")
