"""CheckpointManager: one folder per step under a root, ``latest`` pointer, retention."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from .storage import commit as cm, retention
from .coordination import DEFAULT_TIMEOUT_S, Coordinator
from .errors import CheckpointExistsError, CheckpointNotFoundError, InvalidArgumentError
from .loading.into import load_into
from .loading.reader import load
from .storage.locate import store_for
from .saving.future import SaveFuture
from .format.stateful import to_state_dicts
from .saving.committer import folder_error
from .saving.saver import Saver, save_route

LATEST = "latest"

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Checkpoints of one run: ``{root}/{prefix}{step}`` folders, committed atomically.

    Args:
        root: folder holding the step folders (created on first save).
        keep_last: keep at most this many committed steps, the most recently committed ones
            (``None``: keep all). Pruning runs only after a commit, so the newest committed
            checkpoint is never removed before a newer one is committed, and it never removes the
            step just committed. Steps are ordered by commit time (the manifest's, see
            :func:`fastckpt.storage.retention.manifest_order`), as the Trainer rotates: a new run in
            a root that still holds an earlier run's higher-numbered steps (``step-500`` while this
            run saves ``step-100``) keeps its own newest steps and deletes the earlier run's first.
        prefix: step folder prefix (default ``"step-"``; the Trainer integration uses
            ``"checkpoint-"``).
        lock_timeout_s: seconds a save or prune waits for another job's root lock before
            raising :class:`~fastckpt.errors.CheckpointLockedError` (default 0: fail at once).
            See :mod:`fastckpt.storage.lock`: one writing job per root, never interleaved files.
        process_group: ``torch.distributed`` group whose ranks save each checkpoint together
            (default ``None``: this process saves alone, even when a group is initialized, except
            for states holding DTensors (FSDP2, tensor parallel): those are always saved by every
            rank of their device meshes together). With a group (or a DTensor state), every rank
            calls ``save``; its rank 0 holds the root lock, prunes and updates ``latest``.
        link_unchanged: hard-link shard files whose bytes equal the newest committed step's
            instead of rewriting them (``link_from`` of :func:`fastckpt.async_save`; default
            ``False``). For runs whose large tensors rarely change (LoRA base weights).

    A ``latest`` text file in ``root`` names the most recently committed step; it is replaced
    atomically after each commit. Readers trust the scan of committed folders over it
    (a crash between commit and pointer update leaves the pointer one step behind).

    Example::

        mgr = CheckpointManager("runs/a", keep_last=2)
        mgr.async_save(100, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        ...
        state = mgr.load()          # newest committed step
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = None, prefix: str = "step-",
                 lock_timeout_s: float = 0.0, process_group: Any = None, link_unchanged: bool = False):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise InvalidArgumentError(f"prefix {prefix!r} must be a non-empty plain name not starting with '.'")
        self.store = store_for(InvalidArgumentError.check_path(root, "root"))
        #: the run root: a ``Path`` on the local file system, the store's URL (``str``) elsewhere
        self.root = Path(os.path.abspath(os.fspath(root))) if self.store.local else self.store.path(root)
        self.keep_last = keep_last
        self.prefix = prefix
        self._saver = Saver(process_group)  # this manager's own: its failures stay its own
        self._writer = self._saver.rank == 0  # multi-rank: only rank 0 locks, cleans, prunes
        self._lock = self.store.root_lock(str(self.root))
        self.lock_timeout_s = lock_timeout_s
        self.link_unchanged = link_unchanged
        self._last_saved: int | None = None  # the step this manager committed last (rank 0)

    def path(self, step: int) -> Path:
        """Folder of ``step`` (whether or not it exists; a ``str`` URL on a non-local store)."""
        name = f"{self.prefix}{int(step)}"
        return self.root / name if isinstance(self.root, Path) else self.store.path(self.store.join(self.root, name))

    def _scan(self) -> tuple[list[int], list[tuple[str, str]]]:
        scan = retention.scan_checkpoints(self.root, self.prefix)
        return scan.steps, scan.skipped()

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return retention.scan_checkpoints(self.root, self.prefix).steps

    def skipped(self) -> list[tuple[str, str]]:
        """``(folder name, reason)`` for every folder under ``root`` that looks like a step but is not committed."""
        return self._scan()[1]

    def latest(self) -> int | None:
        """The most recently committed step (by the commit time its manifest records; by step for
        manifests without one), or ``None``. Not the highest step: an earlier run's higher-numbered
        steps left in ``root`` are older commits."""
        newest = retention.scan_checkpoints(self.root, self.prefix).newest()
        return newest[0] if newest else None

    def async_save(self, step: int, state: Any, **options: Any) -> SaveFuture:
        """Start saving ``state`` as ``step``; returns once staged (see :func:`fastckpt.async_save`).

        Raises:
            CheckpointExistsError: ``step`` exists and ``overwrite`` is not true.
            InvalidArgumentError: ``step`` is not a non-negative int.
            FolderNotWritableError / NotAFolderError: the root cannot be created or written (names
                the step folder asked for and the folder at fault).
            (other errors as :func:`fastckpt.async_save`)
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        target = self.path(step)
        if self.store.exists(str(target)) and not options.get("overwrite"):
            raise CheckpointExistsError(f"{target}: step {step} exists; pass overwrite=True to replace it")
        user_hook = options.pop("on_commit", None)

        def after_commit(p: Path) -> None:
            self._last_saved = step
            self._write_latest()
            if self.keep_last is not None:
                self.prune(self.keep_last, protect=(step,))  # never the step just committed
            newer = [s for s in self.steps() if s > step]
            if newer:
                logger.warning("fastckpt: %s holds committed steps %s above the step just saved (%d), committed "
                               "before it: probably an earlier run's. latest()/load() pick the most recently "
                               "committed step (this one); keep_last deletes the oldest commits first",
                               self.root, newer, step)
            if user_hook is not None:
                user_hook(p)

        try:
            self.store.makedirs(str(self.root))
        except OSError as e:
            _raise_typed(target, e)
        state, _ = to_state_dicts(state)  # Stateful values (DCP's protocol): their state_dict(), called once
        writer = self._writer
        route = save_route(state)
        if self._saver.process_group is None and route.dtensor:
            writer = route.leads(state)  # the meshes' ranks save together: their rank 0 keeps the root
        if not writer:  # another rank of a multi-rank save: rank 0 does the root's bookkeeping
            return self._saver.async_save(state, target, step=step, **options)
        try:
            self._lock.acquire(self.lock_timeout_s)  # held until this save committed or failed
        except OSError as e:
            _raise_typed(target, e)
        try:
            self._clean_leftovers()
            prev = self.latest() if self.link_unchanged else None
            if prev is not None and prev != step and "link_from" not in options:
                options["link_from"] = self.path(prev)
            fut = self._saver.async_save(state, target, step=step, on_commit=after_commit, **options)
        except BaseException:
            self._lock.release()
            raise
        fut.add_done_callback(lambda _f: self._lock.release())
        return fut

    def save(self, step: int, state: Any, **options: Any) -> Path:
        """Save ``state`` as ``step`` and return its folder once durable and committed
        (``early_writes`` on by default, as :func:`fastckpt.save`)."""
        options.setdefault("early_writes", True)
        return self.async_save(step, state, **options).result()

    def wait(self) -> None:
        """Wait for the pending save; re-raise its failure if nobody collected it."""
        self._saver.wait()

    def load(self, step: int | None = None, **options: Any) -> dict:
        """Load ``step`` (default: the most recently committed, :meth:`latest`) with
        :func:`fastckpt.load` options.

        The checksums are checked by default, as in :func:`fastckpt.load` (``verify=False`` skips
        them): a damaged byte raises instead of coming back as a weight.

        A save this manager started and that is still in flight is waited for first (its
        failure, if any, is still raised by its ``result()`` or the next save, not here).

        Raises:
            CheckpointNotFoundError: no committed checkpoint (or not that step).
            ChecksumMismatchError: unless ``verify=False``, a stored byte differs from the manifest
                (names the file and the key).
        """
        options.setdefault("verify", True)
        return load(self.path(self._pick(step)), **options)

    def load_into(self, state: Any, step: int | None = None, **options: Any) -> Any:
        """Fill ``state`` in place from ``step`` (default: the most recently committed) with
        :func:`fastckpt.load_into` (any world size to any; plain tensors or DTensors; each rank reads
        only its own shards' bytes, so peak memory stays at the state's own size plus bounded buffers).

        The resume path of sharded (FSDP2 / TP) training: every rank calls it with its live state,
        e.g. ``get_state_dict(model, optim)``; no collective is made. Step choice and warnings as
        :meth:`load`; checksums checked by default (``verify=False`` skips them), the state names
        what is read and dtypes are cast as :func:`fastckpt.load_into` says.

        Returns:
            ``state`` with non-tensor leaves replaced by the checkpoint's (see :func:`fastckpt.load_into`).

        Raises:
            CheckpointNotFoundError: no committed checkpoint (or not that step).
            StateMismatchError: keys differ as ``strict`` forbids (default: a state key the
                checkpoint lacks), or shapes differ (names each key).
            ChecksumMismatchError: unless ``verify=False``, a stored byte differs from the manifest.
        """
        return load_into(state, self.path(self._pick(step)), **options)

    def _pick(self, step: int | None) -> int:
        """The step :meth:`load` / :meth:`load_into` read: waits for this manager's pending save."""
        pending = getattr(self._saver, "_pending", None)
        if pending is not None:
            pending._event.wait()
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"{self.root}: no committed checkpoint")
            # a newer commit whose manifest was damaged is skipped by the scan: never resume past it without a word
            scan = retention.scan_checkpoints(self.root, self.prefix, self.store)
            newer = {self.store.basename(str(p)) for n, p in scan.uncommitted if n > step}
            for n, why in scan.damaged():
                if n not in newer:
                    continue
                logger.warning("fastckpt: loading step %d of %s, but the newer %s is skipped: %s", step, self.root,
                               n, why)
            if self._last_saved is not None and step != self._last_saved:
                logger.warning("fastckpt: loading %s, the most recently committed step, but this manager last "
                               "saved step %d: another job committed %s after it", self.path(step),
                               self._last_saved, self.store.basename(str(self.path(step))))
        elif not isinstance(step, int) or isinstance(step, bool):
            raise InvalidArgumentError(f"{self.root}: step must be an int (a committed step, {self.steps()}) "
                                       f"or None (the newest), got {type(step).__name__} {step!r:.40}")
        elif step not in self.steps():
            raise CheckpointNotFoundError(f"{self.root}: step {step} is not committed (have {self.steps()})")
        return step

    def _write_latest(self) -> None:
        step = self.latest()
        if step is None:
            return
        root = str(self.root)
        self.store.write_file(self.store.join(root, LATEST), f"{step}\n".encode(), replace=True)
        self.store.sync_dir(root)

    def prune(self, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
        """Remove the oldest commits so that the ``keep`` most recently committed steps remain, and
        dead temporaries.

        The most recently committed step and the steps in ``protect`` are never removed. Each folder
        goes through :func:`fastckpt.storage.retention.delete_checkpoint`: renamed to a hidden
        temporary name (so it stops being a checkpoint at once, and a crash in the middle leaves
        a folder the next save or prune removes), then deleted.

        Returns:
            The removed steps.

        Raises:
            CheckpointLockedError: another job holds the root lock (it is saving or pruning).
        """
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise InvalidArgumentError(f"keep must be >= 1 (an int), got {keep!r}")
        if not self.store.isdir(str(self.root)):
            return []
        self._lock.acquire(self.lock_timeout_s)
        try:
            return self._prune_locked(keep, protect)
        finally:
            self._lock.release()

    def _clean_leftovers(self) -> None:
        """Remove dead writers' temporaries and stale ``latest`` temp files (caller holds the lock)."""
        root = str(self.root)
        self.store.clean_stale_temps(root)
        mine = f".{LATEST}.{os.getpid()}.tmp"  # the store's replace=True temporary of `latest`
        try:
            names = self.store.listdir(root)
        except FileNotFoundError:  # an object store's root without objects yet (it has no empty folders)
            names = []
        for n in names:
            if n.startswith(f".{LATEST}.") and n.endswith(".tmp") and n != mine:
                try:
                    self.store.remove(self.store.join(root, n))
                except OSError:
                    pass

    def _prune_locked(self, keep: int, protect: tuple[int, ...]) -> list[int]:
        self._clean_leftovers()
        return retention.prune_checkpoints(self.root, self.prefix, keep, protect, by_manifest_time=True)


def _raise_typed(target: Path, e: OSError) -> None:
    """Re-raise ``e`` as :func:`~fastckpt.saving.committer.folder_error` names it (the step folder
    asked for and the root at fault), or as it is."""
    typed = folder_error(target, e)
    if typed is None:
        raise e
    raise typed from e
#: group -> newest_common_step calls of this process on it: names the call's store keys alike on every
#: rank of the group, whatever other groups did meanwhile (a process-wide counter would not)
_COMMON_CALLS: dict[str, int] = {}
_COMMON_LOCK = threading.Lock()


def committed_steps(root: str | os.PathLike, prefix: str = "step-") -> list[int]:
    """Steps ``{root}/{prefix}{n}`` that hold a valid ``manifest.json`` (commit marker), ascending."""
    pat = re.compile(re.escape(prefix) + r"(\d+)$")
    store = store_for(root)
    try:
        names = store.listdir(os.fspath(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    held = None if store.local else store
    return sorted(int(m.group(1)) for n in names
                  if (m := pat.match(n)) and cm.is_committed(store.join(os.fspath(root), n), held))


def newest_common_step(root: str | os.PathLike, *, prefix: str = "step-", process_group: Any = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> int | None:
    """Newest step committed on every node of ``commit="marker"`` saves (restart point after a crash).

    Every rank of the group calls it with its own node-local ``root``; the committed steps of all
    ranks are exchanged through the group's store and the newest step present everywhere is
    returned (``None``: none). A crash between node markers leaves a step some nodes committed
    and others did not; it is skipped. In one process: the newest committed step under ``root``.

    Args:
        root: this rank's node-local checkpoint root. prefix: step folder prefix (default ``"step-"``).
        process_group: the group of the saves (default: the world group when initialised).
        timeout_s: bound on waiting for the other ranks, in seconds.

    Raises:
        TimeoutError: another rank did not answer within ``timeout_s``.
    """
    coord = Coordinator.for_group(process_group)
    mine = committed_steps(root, prefix)
    with _COMMON_LOCK:
        n = _COMMON_CALLS[coord.group_key] = _COMMON_CALLS.get(coord.group_key, 0) + 1
    sess = coord.session(f"common/{n}", timeout_s)
    try:
        every = sess.all_gather("steps", mine, "listing committed steps")
    finally:
        sess.close()
    common = set(every[0]).intersection(*map(set, every[1:]))
    return max(common) if common else None
