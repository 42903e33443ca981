"""fastckpt: fast, safe checkpoint and weight I/O on one storage tier.

Public API::

    fastckpt.save(state, path, *, process_group=None, overwrite=False, step=None, ...) -> Path   # durable + committed
    fastckpt.async_save(state, path, *, process_group=None, ...) -> SaveFuture  # returns once staged
        (keyword-only options: those of fastckpt.SaveOptions, its IOTuning and Consistency fields by name)
    fastckpt.load(path, *, device="cpu", keys=None, verify=True) -> dict
    fastckpt.load_into(state, path, *, strict=None, verify=True, report=None) -> state   # in place, resharding
    fastckpt.LoadIntoReport                   # missing / unexpected / cast keys of a load_into
    fastckpt.CheckpointManager(root, keep_last=None, prefix="step-", process_group=None)
    fastckpt.newest_common_step(root, process_group=None) -> int | None   # commit="marker" restart point
    fastckpt.Saver(process_group=None)        # a saver of your own (its failures stay its own)
    fastckpt.SaveOptions / IOTuning / Consistency
    fastckpt.verify(path) -> VerifyReport
    fastckpt.check_servable(folder) -> ServableReport   # the servability gate of `fastckpt load`
    fastckpt.is_committed(path) -> bool
    fastckpt.save_route(state) -> SaveRoute  # DTensor route or not, the options it refuses

The package is laid out by layers, imports pointing one way (DESIGN.md):
``integrations`` -> this module -> ``cli`` -> ``manager`` -> ``saving`` | ``loading`` ->
``storage`` -> ``format`` -> ``coordination`` -> ``errors``.
See docs/FORMAT.md for the on-disk format and README.md for figures.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from . import errors
from .storage.commit import read_manifest
from .storage.locate import checkpoint_committed as is_committed
from .errors import (CheckpointExistsError, CheckpointNotFoundError, ChecksumMismatchError,
                     CorruptCheckpointError, DistributedSaveError, FastCkptError, HeaderError,
                     InsufficientSpaceError, RankValuesDifferError, SaveConflictError, UnsupportedDtypeError,
                     UnsupportedValueError)
from .loading.reader import load, open_checkpoint
from .loading.into import LoadIntoReport, load_into
from .loading.source import Source, resolve_source
from .manager import CheckpointManager, newest_common_step
from .coordination import LOCAL
from .saving.future import SaveFuture
from .saving.options import DEFAULT_MAX_SHARD_BYTES, Consistency, IOTuning, SaveOptions
from .storage.io import DEFAULT_CHUNK_BYTES, PosixBackend
from .saving.saver import Saver, SaveRoute, no_gc, save_route
from .loading.verify import VerifyReport, verify
from .loading.servable import ServableReport, check_servable

__version__ = "0.1.0"

_default_saver: Saver | None = None


def _saver() -> Saver:
    global _default_saver
    if _default_saver is None:
        _default_saver = Saver()
    return _default_saver


def async_save(state: Any, path: str | os.PathLike, *, process_group: Any = None,
               overwrite: bool = False, step: int | None = None, weights: dict[str, str] | None = None,
               extra_files: dict[str, bytes] | None = None, metadata: dict[str, str] | None = None,
               on_commit: Callable[[Path], None] | None = None, local_keys: tuple[str, ...] | list[str] = (),
               commit: str | None = None, timeout_s: float | None = None,
               io: IOTuning | None = None, consistency: Consistency | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               threads: int | None = None, staging_bytes: int | None = None, o_direct: bool | None = None,
               io_backend: str | PosixBackend | None = None, min_free_bytes: int = 0,
               link_from: str | os.PathLike | None = None, link_check: str = "hash", early_writes: bool = False,
               defer_frozen: bool = False, defer: Callable[[str, bool], bool] | None = None) -> SaveFuture:
    """Stage ``state`` into host memory and write it to ``path`` in the background.

    Returns as soon as every tensor is copied into the staging buffer: the checkpoint holds
    the values the tensors had at the call even if they change right after, except tensors
    whose copy ``defer`` or ``defer_frozen`` leaves to the background: those must not be written
    until :meth:`SaveFuture.wait_staged` returns (see :class:`~fastckpt.SaveOptions`). A second call
    waits for the previous save of the module-level saver (staging memory stays bounded) and
    raises its failure if nobody collected it.

    Args:
        state: nested dict/list/tuple of tensors (any device, any strides), NumPy arrays and
            JSON-able values (see :func:`fastckpt.format.tree.flatten`). A top-level value with
            ``state_dict()`` / ``load_state_dict()`` (DCP's ``Stateful``, e.g. ``{"app": AppState(model,
            optim)}``) is stored as its ``state_dict()``, called once at the call, as ``dcp.save`` does.
        path: checkpoint folder to create; its parent is created if needed. A store URL
            (``"s3://bucket/run/step-10"``, any fsspec protocol) or ``store.path(...)`` of an explicit
            :class:`fastckpt.storage.Store` saves there: written into a local spool, then uploaded with
            ``manifest.json`` last (docs/FORMAT.md, "Commit strategies and stores"); ``fut.result()``
            then returns the URL. Not with ``process_group`` or ``link_from``.
        process_group: ``torch.distributed`` group whose ranks all save this checkpoint together
            (every rank of it must make the call; each writes part of the bytes; rank 0 commits).
            Default ``None``: this process saves alone, even when a process group is
            initialized (the ``if rank == 0: fastckpt.save(...)`` pattern).
        overwrite, step, weights, extra_files, metadata, on_commit: what to save (defaults: refuse an
            existing ``path``, no step, ``{"model": "model"}``, none, none, none); see
            :class:`fastckpt.SaveOptions`.
        local_keys, commit, timeout_s: multi-rank saves: per-rank top-level keys (default none),
            ``"rename"`` or ``"marker"`` (default ``None``: the store's default, ``"rename"`` on a local
            file system, ``"marker"`` on an object store), seconds to wait for the other ranks (default the
            group's timeout); see :class:`fastckpt.SaveOptions`.
        io, max_shard_bytes, chunk_bytes, threads, staging_bytes, o_direct, io_backend,
            min_free_bytes: how the bytes move, as an :class:`fastckpt.IOTuning` or its fields by
            name (a field given by name and left at its default keeps ``io``'s value); defaults:
            5e9 data bytes per shard file, 8 MiB per write, :func:`fastckpt.storage.io.default_threads`,
            this rank's part of the state, O_DIRECT where supported, the POSIX backend, 0 bytes.
        consistency, link_from, link_check, early_writes, defer_frozen, defer: what the save may assume
            about live tensors, as a :class:`fastckpt.Consistency` or its fields by name (same rule);
            ``early_writes`` is ``False`` here: the call returns after the copy and the writes start
            then.

    DTensor states (FSDP2 ``fully_shard``, tensor parallel: ``Shard(d)`` / ``Replicate()`` on any
    mesh, uneven shards) are saved by every rank together: with ``process_group=None`` the ranks
    of the DTensors' device meshes. The folder holds full tensors in HF layout (docs/FORMAT.md,
    "Version 2"), each rank writing its own chunks; DCP's planner places them and its collectives
    run on a dedicated gloo group (:func:`fastckpt.dcp.background_group`), never the training
    group. ``local_keys`` subtrees (plain per-rank values: RNG states, counters; no DTensors) are
    written by each rank to its own files, as in a ``process_group=`` save, and ``load_into`` restores
    each rank's own. ``commit="marker"``, ``link_from``, ``defer``, ``defer_frozen`` and
    ``staging_bytes`` are refused (``ValueError``) for such states; a rank's failure raises
    ``DistributedSaveError`` on every rank with nothing committed.

    Multi-rank saves (DTensor states, ``process_group=``) store every value that is neither a DTensor
    nor under ``local_keys`` once; the ranks compare those values through the store at the call (JSON
    values; plain tensors: all of them in DTensor states, those of at most 1 MiB with
    ``process_group=``), and a difference raises ``RankValuesDifferError`` on every rank before any
    file exists, instead of keeping one rank's value.

    Returns:
        A :class:`SaveFuture`; ``result()`` returns the path once durable and committed.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false, or ``path`` is not a
            checkpoint or an empty folder (``overwrite`` never deletes other files).
        UnsupportedValueError / UnsupportedDtypeError: a value cannot be stored (names its key
            path; e.g. a DTensor with a ``Partial()`` placement, a tensor subclass); raised before
            any file is created.
        InsufficientSpaceError: not enough free space for the checkpoint.
        SaveConflictError: without ``process_group``, another rank is saving the same path.
        DistributedSaveError: with ``process_group``, a rank failed or did not arrive within
            ``timeout_s`` (default: the group's timeout); ``failures`` names each rank.
        RankValuesDifferError: multi-rank, values stored once differ between ranks (names the key
            paths and the ranks; pass ``local_keys=`` to save them per rank); nothing written.
        InvalidArgumentError: (a ``ValueError`` and a ``TypeError``) a bad or unknown option (e.g.
            ``extra_files`` values not bytes: names the key) or a ``path`` that is not a str /
            ``os.PathLike``; raised at the call.
        FolderNotWritableError: (a ``PermissionError``) the folder ``path`` goes in is read-only or
            not writable; names ``path`` and that folder. NotAFolderError: a parent of ``path`` is a file.
        StoreUnreachableError: the process group's store is gone (torchrun agent or rank 0 died);
            names the rank, the store address and the operation.

    Example::

        fut = fastckpt.async_save({"model": model.state_dict(), "step": 10}, "ckpt/step-10")
        ...                      # keep training
        fut.result()             # durable
    """
    return _saver().async_save(
        state, path, process_group=process_group, overwrite=overwrite, step=step, weights=weights,
        extra_files=extra_files, metadata=metadata, on_commit=on_commit, local_keys=local_keys, commit=commit,
        timeout_s=timeout_s, io=io, consistency=consistency,
        **_given(max_shard_bytes=max_shard_bytes, chunk_bytes=chunk_bytes, threads=threads,
                 staging_bytes=staging_bytes, o_direct=o_direct, io_backend=io_backend,
                 min_free_bytes=min_free_bytes, link_from=link_from, link_check=link_check,
                 early_writes=early_writes, defer_frozen=defer_frozen, defer=defer))


#: Defaults of the :class:`IOTuning` and :class:`Consistency` fields that ``save`` / ``async_save``
#: also take by name.
_FIELD_DEFAULTS = {f.name: f.default for f in (*fields(IOTuning), *fields(Consistency))}


def _given(**flat: Any) -> dict[str, Any]:
    """The group fields given a value other than their default (so ``io=`` / ``consistency=`` keep theirs)."""
    return {k: v for k, v in flat.items() if v is not _FIELD_DEFAULTS[k] and v != _FIELD_DEFAULTS[k]}


def save(state: Any, path: str | os.PathLike, *, process_group: Any = None,
         overwrite: bool = False, step: int | None = None, weights: dict[str, str] | None = None,
         extra_files: dict[str, bytes] | None = None, metadata: dict[str, str] | None = None,
         on_commit: Callable[[Path], None] | None = None, local_keys: tuple[str, ...] | list[str] = (),
         commit: str | None = None, timeout_s: float | None = None,
         io: IOTuning | None = None, consistency: Consistency | None = None,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         threads: int | None = None, staging_bytes: int | None = None, o_direct: bool | None = None,
         io_backend: str | PosixBackend | None = None, min_free_bytes: int = 0,
         link_from: str | os.PathLike | None = None, link_check: str = "hash", early_writes: bool = True,
         defer_frozen: bool = False, defer: Callable[[str, bool], bool] | None = None) -> Path:
    """Write ``state`` to ``path`` and return once every byte is durable and committed.

    Same as ``async_save(state, path, ...).result()`` with ``early_writes=True`` by default (writes
    start while the state is still being copied, since the caller waits for both); the folder
    appears only complete (written to a hidden sibling, fsynced, renamed). Since the caller waits,
    a state of CPU tensors saved by this process alone (no ``process_group``, no DTensors, no
    ``defer``/``defer_frozen``) is not copied into staging memory: each tensor is hashed and written
    straight from its own memory (:mod:`fastckpt.saving.direct`; the files are the same bytes). Another
    thread must not change the tensors meanwhile: an in-place torch write seen on a tensor's version
    counter fails the save with ``SourceChangedError``, nothing committed.

    Args:
        state, path: as :func:`async_save`.
        process_group: ``None`` (default): this process saves alone, even when a process group is
            initialized. A ``torch.distributed`` group: every rank of it must make the same call;
            each writes part of the bytes and rank 0 commits once every rank succeeded.
        overwrite, step, weights, extra_files, metadata, on_commit, local_keys, commit, timeout_s,
            io, max_shard_bytes, chunk_bytes, threads, staging_bytes, o_direct, io_backend,
            min_free_bytes, consistency, link_from, link_check, defer_frozen, defer: as
            :func:`async_save` (:class:`SaveOptions`).
        early_writes: start writing staged units while the state is still copied. Default ``True``.

    Example::

        fastckpt.save({"model": model.state_dict(), "step": 10}, "ckpt/step-10")
        fastckpt.save(state, "ckpt/step-10", process_group=torch.distributed.group.WORLD)  # every rank

    Raises:
        The errors of :func:`async_save`, and any I/O failure (``OSError`` with its errno,
        e.g. ENOSPC, EIO) of the background writers, with nothing committed.
    """
    return _saver().save(
        state, path, process_group=process_group, overwrite=overwrite, step=step, weights=weights,
        extra_files=extra_files, metadata=metadata, on_commit=on_commit, local_keys=local_keys, commit=commit,
        timeout_s=timeout_s, io=io, consistency=consistency,
        **_given(max_shard_bytes=max_shard_bytes, chunk_bytes=chunk_bytes, threads=threads,
                 staging_bytes=staging_bytes, o_direct=o_direct, io_backend=io_backend,
                 min_free_bytes=min_free_bytes, link_from=link_from, link_check=link_check,
                 early_writes=early_writes, defer_frozen=defer_frozen, defer=defer))


def reserve(nbytes: int, *, background: bool = True, pinned: bool | None = None) -> None:
    """Pre-allocate and fault in ``nbytes`` of the staging buffer that :func:`async_save` uses.

    Call it once before training (e.g. with the model's state size in bytes) so the first
    save copies into memory that is already faulted in and blocks for one plain copy.

    Args:
        nbytes: bytes to reserve.
        background: do it in a background thread (default ``True``).
        pinned: page-lock the buffer, as saves of CUDA tensors need (``None``, the default: where
            a CUDA device is present; see :meth:`fastckpt.saving.saver.Saver.reserve`).
    """
    _saver().reserve(nbytes, background=background, pinned=pinned)


def prime_hashes(state: Any, *, weights: dict[str, str] | None = None, background: bool = True) -> int:
    """Hash the frozen ``nn.Parameter`` values of ``state`` for later :func:`async_save` calls
    with ``link_check="version"`` (see :meth:`fastckpt.saving.saver.Saver.prime_hashes`).

    Call it once before training (after loading or resuming): the first save can then link the
    frozen weights from an earlier checkpoint, or with ``defer_frozen=True`` copy them in the
    background, instead of hashing or copying them while training waits.

    Returns:
        Bytes to hash (in a background thread by default; a save waits for it).
    """
    return _saver().prime_hashes(state, weights=weights, background=background)


def wait() -> None:
    """Wait for the pending :func:`async_save` of this process; re-raise an uncollected failure."""
    _saver().wait()


__all__ = ["save", "async_save", "load", "load_into", "LoadIntoReport", "wait", "reserve", "prime_hashes", "verify", "is_committed", "read_manifest", "open_checkpoint",
           "CheckpointManager", "newest_common_step", "Saver", "no_gc", "resolve_source", "Source", "SaveFuture", "SaveOptions", "IOTuning", "Consistency", "LOCAL",
           "VerifyReport", "errors", "FastCkptError", "DistributedSaveError", "RankValuesDifferError", "SaveConflictError",
           "CheckpointNotFoundError", "CheckpointExistsError", "CorruptCheckpointError", "HeaderError",
           "ChecksumMismatchError", "UnsupportedValueError", "UnsupportedDtypeError", "InsufficientSpaceError"]
__all__ += ["check_servable", "ServableReport", "save_route", "SaveRoute", "PosixBackend", "DEFAULT_CHUNK_BYTES",
            "DEFAULT_MAX_SHARD_BYTES"]

#: The layers, importable as ``fastckpt.<name>`` (listed by ``dir(fastckpt)`` beside ``__all__`` once imported).
_LAYERS = ("format", "device", "storage", "saving", "loading", "kv", "coordination", "manager", "cli", "integrations")


def __getattr__(name: str) -> Any:
    """``fastckpt.dcp`` (DCP's storage writer / reader, :mod:`fastckpt.dcp`) imported on first use:
    it imports ``torch.distributed.checkpoint``, which a plain save or load never needs.

    Raises:
        AttributeError: any other unknown name.
    """
    if name == "dcp":
        import importlib
        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``__all__``), ``__version__`` and the layers imported so far: not the helpers
    this module imports for its signatures (``os``, ``Path``, ``Any``...), which stay importable for
    ``typing.get_type_hints``."""
    return sorted({*__all__, "__version__", "dcp", *(n for n in _LAYERS if n in globals())})
