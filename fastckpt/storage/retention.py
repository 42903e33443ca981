"""Retention: which committed checkpoints of a run root to keep, and deleting one safely.

A run root holds one folder per step, ``{prefix}{step}`` (``step-100``, ``checkpoint-100``,
``checkpoint_3``). The one rule, used by :class:`fastckpt.CheckpointManager`, ``fastckpt prune``,
the Trainer callback and the accelerate plugin:

* Only committed folders (see :func:`fastckpt.storage.commit.is_committed`) count and are ever
  deleted; a folder without a valid manifest is left alone.
* The newest committed checkpoint is never deleted, so retention cannot remove the last good
  checkpoint before a newer one is committed (run it after each commit). "Newest" is by commit
  time, as the Trainer rotates by modification time (transformers 5.24.0; a new run in a folder that still holds an
  earlier run's higher-numbered steps keeps its own checkpoints): ``CheckpointManager``, its
  ``latest``, ``fastckpt ls`` / ``prune`` / ``verify`` of a run root order by the commit time the
  manifest records (``created_unix_s``, written with the manifest right before the commit rename;
  :func:`manifest_order`, step order for manifests without it). The Trainer callback follows the
  Trainer's own rule (folder mtime with its 1 s fallback to step order, :func:`commit_order` +
  :func:`select_victims_in_order`). The accelerate plugin and torchtitan order by step, as
  accelerate's and torchtitan's own rotations do. ``CheckpointManager`` and the Trainer callback
  also protect the step just committed.
* A folder is deleted by :func:`delete_checkpoint`: one atomic ``rename`` to a hidden temporary
  name (``.{name}.fastckpt-tmp-{pid}@{host}-{hex}.del``) made durable by an fsync of the root,
  then ``rmtree``. From the rename on it is no checkpoint; if the process dies in the middle,
  :func:`fastckpt.storage.commit.clean_stale_temps` (run by the next ``CheckpointManager`` save,
  the Trainer callback's next save, the accelerate plugin's next rotation and ``fastckpt prune``)
  recognises the leftover as a dead writer's temporary and removes it.

Call order for one root: :func:`scan_checkpoints` (or :func:`prune_checkpoints`, which runs
``clean_stale_temps`` -> scan -> :func:`select_victims` -> :func:`delete_checkpoint` per victim).
None of these takes the root lock (:class:`fastckpt.storage.lock.RootLock`); the caller does
when several jobs may share the root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ..format.layout import ENGINE_TAG_MARKER
from . import commit as cm
from .locate import store_for
from .store import Store
from .tier import tier_for

#: Suffix of the hidden name a folder gets while :func:`delete_checkpoint` removes it.
DOOMED_SUFFIX = ".del"


@dataclass(frozen=True)
class CheckpointScan:
    """What :func:`scan_checkpoints` found under a run root.

    Attributes:
        root: the run root (a ``Path``; a ``str`` URL on a non-local store, whose folders are URLs too).
        committed: ``(step, folder)`` of every committed step folder, ascending by step.
        uncommitted: ``(step, folder)`` of step-named folders without a valid manifest (a
            crashed save of another tool, or not fastckpt), ascending by step.
        leftovers: names of hidden fastckpt temporaries (unfinished saves, interrupted
            deletions), sorted.
    """

    root: Path | str
    committed: list[tuple[int, Path]] = field(default_factory=list)
    uncommitted: list[tuple[int, Path]] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    store: Store | None = None
    #: ``(step, folder, target)`` of step folders that are symlinks (an alias of another checkpoint):
    #: neither counted among the steps nor ever deleted (a prune removed the alias's target).
    aliases: list[tuple[int, Path, str]] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [s for s, _ in self.committed]

    def by_commit(self) -> list[int]:
        """Committed steps, oldest commit first (:func:`manifest_order`)."""
        return manifest_order(self.committed, self.store)

    def newest(self) -> tuple[int, Path] | None:
        """``(step, folder)`` of the most recently committed checkpoint (:func:`manifest_order`), or
        ``None``. With an earlier run's higher-numbered steps in the root this is this run's newest."""
        order = manifest_order(self.committed, self.store)
        return (order[-1], dict(self.committed)[order[-1]]) if order else None

    def damaged(self) -> list[tuple[str, str]]:
        """``(folder name, reason)`` of the step folders that hold a ``manifest.json`` no reader accepts:
        committed (a commit writes the manifest whole before the folder appears), then damaged."""
        store = self.store or store_for(None)
        out = []
        for _, p in self.uncommitted:
            folder = store.join(str(self.root), store.basename(str(p)))
            try:
                there = store.exists(store.join(folder, cm.MANIFEST))
            except OSError:
                there = False
            if there:
                out.append((store.basename(str(p)), _damaged_reason(folder)))
        return out

    def engine_tags(self) -> list[str]:
        """Names of the step folders that are DeepSpeed tags written by fastckpt's engine (committed:
        their ``*_states.pt`` folders are the checkpoints; ``fastckpt_tag.json`` marks them)."""
        store = self.store or store_for(None)
        return [store.basename(str(p)) for _, p in self.uncommitted
                if _is_engine_tag(store, store.join(str(self.root), store.basename(str(p))))]

    def skipped(self) -> list[tuple[str, str]]:
        """``(folder name, reason)`` for every leftover and uncommitted folder, sorted by name.

        Checks whether each leftover's writer is alive (an owner-record read per leftover).
        """
        store = self.store or store_for(None)
        out = [(n, describe_leftover(store.join(str(self.root), n), store)) for n in self.leftovers]
        out += [(store.basename(str(p)), _uncommitted_reason(store, store.join(str(self.root), store.basename(str(p)))))
                for _, p in self.uncommitted]
        out += [(store.basename(str(p)), f"a symlink to {target}: an alias, not counted among the steps and never "
                 "deleted (prune the checkpoint it points to in its own run)") for _, p, target in self.aliases]
        return sorted(out)


def is_temp_name(name: str) -> bool:
    """True if ``name`` (a folder name) is a fastckpt temporary: a save in progress or a
    folder being deleted (never a checkpoint)."""
    return name.startswith(".") and cm.TMP_MARK in name


def describe_leftover(path: str, store: Store | None = None) -> str:
    """One line saying what temporary folder ``path`` is and what happens to it."""
    state = "live writer" if store_for(path, store).owner_alive(path) else \
        "dead writer, removed by the next CheckpointManager save or `fastckpt prune`"
    if path.endswith(DOOMED_SUFFIX):
        return f"checkpoint being deleted ({state})"
    return f"temporary folder of an unfinished save ({state})"


def step_folders(root: str | os.PathLike, prefix: str, store: Store | None = None) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``{prefix}{step}`` folder of ``root``, ascending by step,
    committed or not (no manifest is read: one ``listdir`` plus one ``stat`` per match).

    Args:
        root: run root; a missing root gives ``[]``.
        prefix: step folder prefix, e.g. ``"step-"``, ``"checkpoint-"`` or ``"checkpoint_"``.
        store: the store holding ``root`` (default: :func:`fastckpt.storage.store.store_for`);
            folders of a non-local store are ``str`` URLs.
    """
    store = store_for(root, store)
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    top = _root(root, store)
    try:
        names = store.listdir(str(top))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), _child(top, n, store)) for n in names if (m := pattern.match(n))]
    return sorted((s, p) for s, p in found if store.isdir(str(p)))


def _root(root, store: Store) -> Path | str:
    """``root`` normalised: a ``Path`` on the local store, the store's spelling elsewhere."""
    return Path(os.path.abspath(os.fspath(root))) if store.local else store.normalize(root)


def _child(top: Path | str, name: str, store: Store) -> Path | str:
    return top / name if isinstance(top, Path) else store.join(top, name)


def scan_checkpoints(root: str | os.PathLike, prefix: str, store: Store | None = None) -> CheckpointScan:
    """Sort the folders of ``root`` into committed steps, uncommitted step folders and leftovers.

    Args:
        root: run root; a missing root gives an empty scan.
        prefix: step folder prefix, e.g. ``"step-"``, ``"checkpoint-"`` or ``"checkpoint_"``.
        store: the store holding ``root`` (default: :func:`fastckpt.storage.store.store_for`).

    Returns:
        A :class:`CheckpointScan`. Reads every step folder's manifest (memoised on its inode and
        mtime by :func:`fastckpt.storage.commit.read_manifest_shared`); to find only the newest
        committed step, walk :func:`step_folders` backwards instead.
    """
    store = store_for(root, store)
    scan = CheckpointScan(_root(root, store), store=None if store.local else store)
    try:
        scan.leftovers.extend(sorted(n for n in store.listdir(str(scan.root)) if is_temp_name(n)))
    except (FileNotFoundError, NotADirectoryError):
        return scan
    for step, folder in step_folders(scan.root, prefix, store):
        target = store.link_target(str(folder))
        if target is not None:  # deleting through it, or writing its owner record into it, touched its target
            scan.aliases.append((step, folder, target))
            continue
        (scan.committed if cm.is_committed(folder, scan.store) else scan.uncommitted).append((step, folder))
    return scan


def commit_time(folder: str | os.PathLike, store: Store | None = None) -> float | None:
    """When the committed checkpoint ``folder`` was committed: its manifest's ``created_unix_s``
    (seconds since the epoch, written with the manifest right before the commit rename), or
    ``None`` when the manifest lacks it or cannot be read (memoised manifest read, one ``stat``)."""
    try:
        t = cm.read_manifest_shared(folder, store).created_unix_s
    except (OSError, ValueError):  # CorruptCheckpointError is a ValueError
        return None
    return None if t is None else float(t)


def newest_committed(root: str | os.PathLike, names: list[str], store: Store | None = None) -> str:
    """The name in ``names`` (committed checkpoints in folder ``root``) committed last by
    :func:`commit_time` (the last name when none has one): for a hint naming one of them, where the
    last in sort order is not the newest (``epoch=9-...`` sorts after ``epoch=10-...``)."""
    def created(n: str) -> float:
        t = commit_time(os.path.join(os.fspath(root), n), store)
        return float("-inf") if t is None else t
    return max(reversed(names), key=created)


def manifest_order(committed: Sequence[tuple[int, Path]], store: Store | None = None) -> list[int]:
    """Committed steps ordered oldest commit first, by :func:`commit_time` (ties by step).

    Unlike :func:`commit_order` (the Trainer's folder mtime rule) no 1 s fallback: the manifest
    time is written by the committing process and not changed by later writes into the folder.
    If any manifest lacks the time (or cannot be read), the order is by step.

    Args:
        committed: ``(step, folder)`` pairs (e.g. :attr:`CheckpointScan.committed`).
        store: the store holding them (default: the local file system).

    Returns:
        The steps, oldest commit first.
    """
    timed = [(commit_time(p, store), s) for s, p in committed]
    if any(t is None for t, _ in timed):
        return sorted(s for s, _ in committed)
    return [s for _, s in sorted(timed)]


def select_victims(steps: Sequence[int], keep: int, protect: Iterable[int] = (),
                   ordered: bool = False) -> list[int]:
    """The committed steps to delete so that the newest ``keep`` remain (pure, no I/O).

    The newest ``keep`` steps and every step in ``protect`` are kept; the newest step is always
    kept (also when ``protect`` names others), so a retention pass run after a commit never
    deletes the checkpoint just committed.

    Args:
        steps: committed steps (any order; duplicates ignored), or with ``ordered`` oldest first
            (e.g. :func:`manifest_order`).
        keep: how many of the newest steps to keep, >= 1.
        protect: steps never to delete (e.g. the best checkpoint), kept in addition.
        ordered: ``steps`` are already ordered oldest first (default False: newest = highest step).

    Returns:
        The steps to delete, oldest first (ascending without ``ordered``).

    Raises:
        ValueError: ``keep`` is not an int >= 1.

    Example::

        >>> select_victims([1, 2, 3, 4], keep=2, protect=[1])
        [2]
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be >= 1 (an int), got {keep!r}")
    order = list(dict.fromkeys(steps)) if ordered else sorted(set(steps))
    kept = set(order[-keep:]) | set(protect)
    return [s for s in order if s not in kept]


def commit_order(committed: Sequence[tuple[int, Path]], use_mtime: bool = True,
                 store: Store | None = None) -> list[int]:
    """Committed steps ordered oldest first as ``transformers.trainer_utils.sort_checkpoints``
    orders them for the Trainer's rotation (``use_mtime=True`` in ``Trainer._save_checkpoint``,
    transformers 5.24.0): by the folder's modification time (for a fastckpt folder: when its last
    file was written, i.e. its commit), falling back to step order when the newest and oldest
    times lie less than 1.0 s apart (a filesystem whose mtimes are not trustworthy, or a burst of
    saves). Ties are broken by step.

    Args:
        committed: ``(step, folder)`` pairs (e.g. :attr:`CheckpointScan.committed`).
        use_mtime: False orders by step only.
        store: the store holding the folders (default: the local file system).

    Returns:
        The steps, oldest first. A folder that vanished meanwhile sorts by step as time 0.
    """
    st = store_for(None, store)

    def mtime(p: Path) -> float:
        try:
            return st.mtime(str(p))
        except OSError:
            return 0.0

    by_step = sorted(s for s, _ in committed)
    if not use_mtime or len(committed) < 2:
        return by_step
    timed = sorted((mtime(p), s) for s, p in committed)
    if timed[-1][0] - timed[0][0] < 1.0:
        return by_step
    return [s for _, s in timed]


def select_victims_in_order(order: Sequence[int], keep: int, protect: Iterable[int] = ()) -> list[int]:
    """The Trainer's rotation rule (``transformers.trainer_utils.rotate_checkpoints``, 5.24.0)
    over steps already ordered oldest first (pure, no I/O).

    The last step of ``order`` (the most recent) and every step of ``protect`` (the best
    checkpoint, the one just committed) are kept; the oldest others are deleted until
    ``max(keep, number kept by protection)`` remain. Unlike :func:`select_victims`, protected
    steps count among ``keep``.

    Args:
        order: committed steps, oldest first (e.g. from :func:`commit_order`).
        keep: ``save_total_limit``, >= 1.
        protect: steps never to delete.

    Returns:
        The steps to delete, in ``order``'s order.

    Raises:
        ValueError: ``keep`` is not an int >= 1.

    Example::

        >>> select_victims_in_order([500, 100, 200], keep=1, protect=[200])   # 500: an earlier run
        [500, 100]
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be >= 1 (an int), got {keep!r}")
    order = list(dict.fromkeys(order))
    if len(order) <= keep:
        return []
    protected = {order[-1]} | (set(protect) & set(order))
    remaining, victims = len(order), []
    for s in order:
        if remaining <= max(keep, len(protected)):
            break
        if s not in protected:
            victims.append(s)
            remaining -= 1
    return victims


def freed_shard_bytes(folder: str) -> int:
    """Bytes of the ``*.safetensors`` files under ``folder`` that deleting it frees: those with no other
    hard link (a ``link_from`` save shares unchanged files). What a save claims on the tier arbiter is the
    same: its shard files, not the ones it linked, not its small JSON files. 0 for an object store."""
    n = 0
    for d, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".safetensors"):
                try:
                    st = os.lstat(os.path.join(d, name))
                except OSError:
                    continue
                if st.st_nlink <= 1:
                    n += st.st_size
    return n


def delete_checkpoint(path: str | os.PathLike, store: Store | None = None) -> bool:
    """Delete the checkpoint folder ``path`` so that no crash leaves a half-deleted checkpoint.

    Steps: rename ``path`` to a hidden temporary sibling ``.{name}.fastckpt-tmp-{pid}@{host}-{hex}.del``
    (one atomic ``rename``: from here on it is no checkpoint), write an owner record into it
    (pid, host, time: a later pid reuse cannot make it look alive), fsync the parent folder (the
    rename is durable before any file goes), then ``rmtree``. A process killed after the rename
    leaves a folder that :func:`fastckpt.storage.commit.clean_stale_temps` removes once this
    process is gone (the next save or ``fastckpt prune``); ``fastckpt ls`` shows it as a
    checkpoint being deleted, never as a checkpoint.

    On a store without an atomic rename (an object store) the first step is removing the
    ``manifest.json`` instead (from then on it is no checkpoint), then the rest; a process killed
    in between leaves an uncommitted folder (listed by ``fastckpt ls``, never loaded).

    Args:
        path: a step folder (committed or not: the caller decides what to delete).
        store: the store holding it (default: :func:`fastckpt.storage.store.store_for`).

    Returns:
        True if the folder was removed, False if ``path`` did not exist.

    Raises:
        OSError: the rename failed (e.g. EACCES, EBUSY); ``path`` is then untouched. Errors of
            the removal itself are ignored: what stays is a leftover the cleaner removes.
    """
    store = store_for(path, store)
    doomed = store.retire(store.normalize(path), DOOMED_SUFFIX)
    if doomed is None:
        return False
    size = freed_shard_bytes(doomed)
    store.remove(doomed)
    if size:  # the tier's capacity budget (a local tier: an object store's folder walks to 0 bytes)
        tier_for(store.parent(store.normalize(path))).add_stored("checkpoints", store.parent(store.normalize(path)), -size)
    return True


def prune_checkpoints(root: str | os.PathLike, prefix: str, keep: int,
                      protect: Iterable[int] = (), by_commit_time: bool = False,
                      by_manifest_time: bool = False, store: Store | None = None) -> list[int]:
    """Remove dead writers' temporaries in ``root``, then the committed steps beyond the newest ``keep``.

    Selection is :func:`select_victims` over the committed steps of :func:`scan_checkpoints`
    (``by_manifest_time=True``: ordered by :func:`manifest_order`, as ``CheckpointManager`` and
    ``fastckpt prune``; ``by_commit_time=True``: :func:`select_victims_in_order` over
    :func:`commit_order`, the Trainer's rule); each victim goes through :func:`delete_checkpoint`.
    Uncommitted folders are left alone.

    Args:
        root: run root (a missing root removes nothing).
        prefix: step folder prefix (``"step-"``, ``"checkpoint-"``, ...).
        keep: newest committed steps to keep, >= 1.
        protect: steps never to delete, kept in addition to the newest ``keep`` (with
            ``by_commit_time``: counted among ``keep``, as the Trainer counts its best checkpoint).
            A step that a symlinked step folder of ``root`` points to is protected too (the scan's
            ``aliases``: never counted, never deleted).
        by_commit_time: the Trainer's rule: folder mtime, 1 s fallback to step order (default False).
        by_manifest_time: newest = most recently committed by the manifest's time (default False:
            newest = highest step, as accelerate's and torchtitan's rotations).
        store: the store holding ``root`` (default: :func:`fastckpt.storage.store.store_for`).

    Returns:
        The deleted steps, oldest first (by step, or by commit with either option).

    Raises:
        ValueError: ``keep`` is not an int >= 1.
        OSError: a victim could not be renamed (the steps before it are already deleted).
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be >= 1 (an int), got {keep!r}")
    store = store_for(root, store)
    store.clean_stale_temps(str(_root(root, store)))
    scan = scan_checkpoints(root, prefix, store)
    folders = dict(scan.committed)
    if scan.aliases:  # a step an alias in this root points to stays (the alias would dangle)
        real = {store.realpath(str(f)): s for s, f in scan.committed}
        protect = {*protect, *(real[t] for _, a, _ in scan.aliases if (t := store.realpath(str(a))) in real)}
    if by_commit_time:
        victims = select_victims_in_order(commit_order(scan.committed, store=store), keep, protect)
    elif by_manifest_time:
        victims = select_victims(scan.by_commit(), keep, protect, ordered=True)
    else:
        victims = select_victims(scan.steps, keep, protect)
    return [s for s in victims if delete_checkpoint(folders[s], store)]


def _damaged_reason(folder: str) -> str:
    return (f"{cm.MANIFEST} is there but unreadable: damaged after the commit (a commit writes it whole "
            f"before the folder appears); run `fastckpt verify {folder}`, restore it or delete the folder")


def _is_engine_tag(store, folder: str) -> bool:
    """Whether ``folder`` is a DeepSpeed tag of fastckpt's engine (its marker file; never raises)."""
    try:
        return store.exists(store.join(folder, ENGINE_TAG_MARKER))
    except OSError:
        return False


def _uncommitted_reason(store, folder: str) -> str:
    """Why a step folder without a valid manifest is skipped: a checkpoint another tool wrote (DCP's
    ``.metadata``), a DeepSpeed tag of fastckpt's engine (``*_states.pt`` folders, ``fastckpt_tag.json``),
    or a save that never committed."""
    try:
        if store.exists(store.join(folder, ".metadata")):
            return "a torch.distributed.checkpoint (DCP) folder (.metadata), not fastckpt's: left alone"
        if _is_engine_tag(store, folder):
            return ("a committed DeepSpeed tag written by fastckpt's engine (fastckpt_tag.json; its *_states.pt "
                    "folders are the checkpoints): `fastckpt verify` it; DeepSpeed keeps its own tags: left alone")
        if store.exists(store.join(folder, cm.MANIFEST)):  # visible and with a manifest: committed, then damaged
            return _damaged_reason(folder)
    except OSError:
        pass
    return "no valid manifest.json: never committed (crashed save or not fastckpt)"
