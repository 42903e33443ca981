"""Options of one save, in three small groups plus the multi-rank ones.

- what to save: ``overwrite``, ``weights``, ``extra_files``, ``metadata``, ``step``, ``on_commit``;
- :class:`IOTuning`: how the bytes move (``max_shard_bytes``, ``chunk_bytes``, ``threads``,
  ``staging_bytes``, ``o_direct``, ``io_backend``, ``min_free_bytes``);
- :class:`Consistency`: the policy integrations pass for snapshots of live training state
  (``link_from``, ``link_check``, ``early_writes``, ``defer_frozen``, ``defer``);
- multi-rank: ``local_keys``, ``commit``, ``timeout_s`` (used when ``process_group`` is given).

Every option means the same for one rank or many. Flat keyword arguments
(``fastckpt.save(state, path, o_direct=True)``) are routed into their group by
:class:`SaveOptions`; passing a group object (``io=IOTuning(...)``) works too.
"""

from __future__ import annotations

import difflib
import operator
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import InvalidArgumentError
from ..format.layout import internal_stem, written_by_save
from ..format.safetensors import check_metadata
from ..storage import commit as cm
from ..storage.io import DEFAULT_CHUNK_BYTES, PosixBackend
from ..storage.store import STRATEGIES

#: Default data bytes per shard file (5e9, as HF ``save_pretrained``).
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
#: ``commit=`` modes of a multi-rank save.
COMMIT_MODES = tuple(STRATEGIES)


@dataclass(frozen=True)
class IOTuning:
    """How the bytes of a save move. Changes speed and memory, never the files.

    Attributes:
        max_shard_bytes: data bytes per shard file (default 5e9, as HF).
        chunk_bytes: bytes per write request (default 8 MiB; a multiple of 4096).
        threads: parallel I/O threads per rank (default :func:`fastckpt.storage.io.default_threads`);
            a blocking save written from the tensors' memory runs at most the CPUs + 1 of them at once
            (:func:`fastckpt.saving.direct.direct_lanes`).
        staging_bytes: staging memory budget per rank in bytes (default: this rank's part of the
            state, so the caller is released after one memory copy); smaller budgets stream
            through a ring of ``chunk_bytes`` slots while the caller waits.
        o_direct: write with O_DIRECT (the staged bytes go straight to the disk, no page-cache
            copy). ``None`` (default): where the file system supports it; ``False``: buffered.
            :func:`fastckpt.save` of CPU tensors stages nothing: O_DIRECT pieces pass through a
            small page-aligned buffer per I/O thread, buffered ones are written from the tensors'
            memory (:mod:`fastckpt.saving.direct`).
        io_backend: name in :data:`fastckpt.storage.io.BACKENDS` or a backend instance.
        min_free_bytes: free bytes required beyond the checkpoint (default 0).
    """

    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: int | None = None
    staging_bytes: int | None = None
    o_direct: bool | None = None
    io_backend: str | PosixBackend | None = None
    min_free_bytes: int = 0


@dataclass(frozen=True)
class Consistency:
    """What a save may assume about the caller's tensors while it runs (set by integrations).

    Attributes:
        link_from: a previous committed checkpoint folder (default ``None``). Every shard file
            whose bytes would be identical to the same-named file there (same header, same
            xxh3-64 of every tensor, hashed from the source tensors at the call) is hard-linked
            instead of staged and written; see :mod:`fastckpt.saving.dedupe`.
        link_check: how ``link_from`` proves a tensor unchanged at the call. ``"hash"``
            (default): xxh3 of every source tensor of a candidate file, in the caller's thread.
            ``"version"``, for states holding live ``torch.nn.Parameter`` objects: a frozen
            parameter (``requires_grad=False``, CPU) with the same storage, dtype, shape,
            offset and version counter as when this saver last hashed it is taken as unchanged
            without hashing at the call; it is re-hashed in the background before the commit,
            and a mismatch its version counter did not show (a write through ``.data`` or a
            NumPy view) fails the save with :class:`~fastckpt.errors.LinkedTensorChangedError`.
            Files holding a trainable parameter are staged (fused optimizers step parameters
            without bumping the counter).
        early_writes: start writing each staged unit while the caller still copies (host
            sources, whole-state staging): lower total time, longer blocking. Default ``False``
            for :func:`fastckpt.async_save`; :func:`fastckpt.save` turns it on.
        defer_frozen: with ``link_check="version"``, frozen parameters whose recorded hash their
            version counter still vouches for (:func:`fastckpt.prime_hashes`) are copied into
            staging by the background thread and checked against that hash before the commit.
            The caller must not write them until the save is done. Default ``False``.
        defer: ``(key path, trainable) -> bool`` (default ``None``): host tensors it accepts
            (never frozen parameters) are copied by the background thread, not during the call;
            the caller must not write them until :meth:`SaveFuture.wait_staged` returns (the
            pipelined snapshot of CheckFreq, Mohan et al., FAST 2021). A torch in-place write
            that finished before the copy fails the save with
            :class:`~fastckpt.errors.SourceChangedError`; a write still running when the copy
            ends and writes that bypass the version counter (``.data``, fused optimizers) are
            not seen: wait first. The copy is a Python thread: it overlaps work that releases
            the GIL (torch ops).
    """

    link_from: str | os.PathLike | None = None
    link_check: str = "hash"
    early_writes: bool = False
    defer_frozen: bool = False
    defer: Callable[[str, bool], bool] | None = field(default=None, repr=False)


_IO = {f.name for f in fields(IOTuning)}
_CONSISTENCY = {f.name for f in fields(Consistency)}


class SaveOptions:
    """All options of :func:`fastckpt.save` / :func:`fastckpt.async_save` (keyword-only there).

    Args:
        overwrite: replace an existing ``path`` atomically (default ``False``: refuse). Only a fastckpt
            checkpoint folder (committed, or an unfinished ``commit="marker"`` save) or an empty folder is replaced; any other file or folder is refused
            with :class:`~fastckpt.errors.CheckpointExistsError` (nothing is deleted).
        weights: top-level state key -> HF file stem (default ``{"model": "model"}``). Tensors
            directly under that key are written with their own names as
            ``{stem}-0000k-of-0000n.safetensors`` + ``{stem}.safetensors.index.json``; a stem
            ending in ``.safetensors`` is one file of exactly that name.
        extra_files: file name -> bytes, small files committed with the checkpoint.
        metadata: ``str -> str`` stored in every shard's ``__metadata__``.
        step: training step recorded in the manifest (``int`` or ``None``).
        on_commit: callback ``(path)`` run in the writer thread (rank 0) after the commit.
        io: an :class:`IOTuning`, or give its fields as flat keywords.
        consistency: a :class:`Consistency`, or give its fields as flat keywords.
        local_keys: multi-rank saves (``process_group=`` or a DTensor state): top-level keys whose
            subtree differs between ranks (each rank's RNG state, a per-rank counter, a ZeRO
            optimizer partition); each rank writes its own files for them and ``load_into`` restores
            each rank's. Values outside them that differ between ranks are refused
            (:class:`~fastckpt.errors.RankValuesDifferError`).
        commit: ``"rename"`` (a hidden folder renamed into place; multi-rank: one shared file
            system, rank 0 renames it) or ``"marker"`` (files written in place, ``manifest.json``
            last; multi-rank on node-local disks: each node writes its own folder, its manifest
            once every rank reported). Default ``None``: the store's default, ``"rename"`` on a
            local file system, ``"marker"`` on an object store (``s3://...``).
        timeout_s: multi-rank saves: seconds to wait for the other ranks, counted from the
            first rank's arrival (default: the process group's timeout).
        **flat: fields of :class:`IOTuning` and :class:`Consistency` by name.

    Raises:
        InvalidArgumentError: an unknown option (names the closest known one), or ``local_keys``
            given as one str; a ``TypeError``.
    """

    def __init__(self, *, overwrite: bool = False, weights: dict[str, str] | None = None,
                 extra_files: dict[str, bytes] | None = None, metadata: dict[str, str] | None = None,
                 step: int | None = None, on_commit: Callable[[Path], None] | None = None,
                 io: IOTuning | None = None, consistency: Consistency | None = None,
                 local_keys: tuple[str, ...] | list[str] = (), commit: str | None = None,
                 timeout_s: float | None = None, **flat: Any):
        if isinstance(local_keys, str):  # tuple() would take its letters for keys
            raise InvalidArgumentError(f"local_keys must be a list of top-level state keys, e.g. "
                                       f"local_keys=[{local_keys!r}], got the str {local_keys!r}")
        self.overwrite, self.weights, self.extra_files = overwrite, weights, extra_files
        self.metadata, self.step, self.on_commit = metadata, step, on_commit
        self.local_keys, self.timeout_s = tuple(local_keys), timeout_s
        self.commit = "rename" if commit is None else commit
        io_kw = {k: flat.pop(k) for k in list(flat) if k in _IO}
        cons_kw = {k: flat.pop(k) for k in list(flat) if k in _CONSISTENCY}
        if flat:
            name = next(iter(flat))
            close = difflib.get_close_matches(name, sorted(_IO | _CONSISTENCY | _TOP), n=1)
            raise InvalidArgumentError(f"unknown save option {name!r}"
                                       + (f"; did you mean {close[0]!r}?" if close else ""))
        self.io = replace(io or IOTuning(), **io_kw)
        self.consistency = replace(consistency or Consistency(), **cons_kw)

    def __repr__(self) -> str:
        return (f"SaveOptions(overwrite={self.overwrite}, weights={self.weights}, step={self.step}, "
                f"io={self.io}, consistency={self.consistency}, local_keys={self.local_keys}, commit={self.commit!r})")

    @property
    def stems(self) -> dict[str, str]:
        """``weights`` with its default applied."""
        return self.weights if self.weights is not None else {"model": "model"}

    def check(self) -> None:
        """Raise :class:`~fastckpt.errors.InvalidArgumentError` (a ``ValueError`` and a ``TypeError``)
        naming the first bad option, the key at fault for a dict option, and what is expected."""
        io, c = self.io, self.consistency
        for name in ("max_shard_bytes", "chunk_bytes"):
            v = getattr(io, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int of bytes, got {v!r}")
        if io.chunk_bytes % 4096:
            raise InvalidArgumentError(f"chunk_bytes must be a multiple of 4096, got {io.chunk_bytes}")
        if io.threads is not None and (not isinstance(io.threads, int) or io.threads < 1):
            raise InvalidArgumentError(f"threads must be a positive int, got {io.threads!r}")
        if io.staging_bytes is not None and (not isinstance(io.staging_bytes, int) or io.staging_bytes <= 0):
            raise InvalidArgumentError(f"staging_bytes must be a positive int of bytes, got {io.staging_bytes!r}")
        ef = self.extra_files
        if ef is not None and not isinstance(ef, dict):
            raise InvalidArgumentError(f"extra_files must be a dict of file name -> bytes, e.g. "
                                       f"{{'notes.txt': b'...'}}, got a {type(ef).__name__}: {ef!r:.80}")
        for n, data in (ef or {}).items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise InvalidArgumentError(
                    f"extra_files[{n!r}] must be bytes (the file's contents), got a {type(data).__name__}: "
                    f"{data!r:.80}; encode text with .encode() (e.g. json.dumps(value).encode())")
            if not _plain_path(n) or n in (cm.MANIFEST, cm.STATE_JSON):
                raise InvalidArgumentError(f"extra file name {n!r} is reserved or not a plain file name (a sub-folder "
                                 "is written as 'folder/name', as peft writes a second adapter)")
            if written_by_save(n, self.stems.values()):
                raise InvalidArgumentError(
                    f"extra file name {n!r} is a file this save writes itself (its weights groups "
                    f"{sorted(self.stems.values())}: {{stem}}.safetensors, {{stem}}-0000k-of-0000n.safetensors and "
                    "their index; fastckpt's own state-*.safetensors, rank*-*.safetensors, state-rank*.json); "
                    "the weights come from the state, not from extra_files: rename the file or pass the tensors "
                    "in the state")
            if n.endswith(".safetensors"):
                _check_safetensors_bytes(n, data)
        for name in ("early_writes", "defer_frozen"):
            if not isinstance(getattr(c, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(c, name)!r}")
        if c.defer is not None and not callable(c.defer):
            raise InvalidArgumentError(f"defer must be a callable (key path, trainable) -> bool, got {c.defer!r}")
        if c.link_check not in ("hash", "version"):
            raise InvalidArgumentError(f"link_check must be 'hash' or 'version', got {c.link_check!r}")
        w = self.weights
        if w is not None and not (isinstance(w, dict) and all(isinstance(k, str) and _plain_path(v)
                                                               for k, v in w.items())):
            raise InvalidArgumentError(f"weights must be a dict of top-level state key -> HF file stem, e.g. "
                             f"{{'model': 'model'}} (file model.safetensors, model-0000k-of-0000n.safetensors "
                             f"past one shard; 'sub/adapter_model.safetensors' in a sub-folder), got {w!r}")
        if w and (own := sorted(f"{k!r}: {v!r}" for k, v in w.items() if internal_stem(v.rsplit("/", 1)[-1]))):
            raise InvalidArgumentError(f"weights {{{', '.join(own)}}}: 'state' and 'rank<N>' are the stems of "
                                       "fastckpt's own files (state-0000k-of-0000n.safetensors...); a weights group "
                                       "there would merge into them, with no HF index. Name the group otherwise "
                                       "(e.g. 'model')")
        if self.commit not in COMMIT_MODES:
            raise InvalidArgumentError(f"commit must be one of {COMMIT_MODES}, got {self.commit!r}")
        if self.timeout_s is not None and (not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0):
            raise InvalidArgumentError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.on_commit is not None and not callable(self.on_commit):
            raise InvalidArgumentError(f"on_commit must be a callable (path) -> None, got {self.on_commit!r:.80}")
        if not all(isinstance(k, str) for k in self.local_keys):
            raise InvalidArgumentError(f"local_keys must be top-level state keys (str), got {self.local_keys!r}")
        if self.step is not None:
            try:
                if isinstance(self.step, bool):
                    raise TypeError
                self.step = operator.index(self.step)  # numpy / torch integer scalars as int
            except TypeError:
                raise InvalidArgumentError(f"step must be an int (the training step) or None, got "
                                           f"{type(self.step).__name__} {self.step!r:.80}") from None
        check_metadata(self.metadata, path="save option metadata=")


def _check_safetensors_bytes(name: str, data: bytes | bytearray | memoryview) -> None:
    """Every ``*.safetensors`` file of a checkpoint is read as one (headers validated at each load):
    an extra file by that name must be a safetensors file, or the committed checkpoint would not load.
    Checked as a load checks a file's header (:func:`fastckpt.format.safetensors.read_header_at`).

    Raises:
        InvalidArgumentError: names the file and what is wrong with its bytes.
    """
    from ..errors import FastCkptError
    from ..format.safetensors import read_header_at
    mv = memoryview(data).cast("B")
    try:
        read_header_at(lambda offset, n: bytes(mv[offset:offset + n]), len(mv), name)
    except FastCkptError as e:
        raise InvalidArgumentError(
            f"extra_files[{name!r}] is named .safetensors but is not a safetensors file ({e}); every *.safetensors "
            "file of a checkpoint is read as one, so the checkpoint would not load. Pass the bytes of "
            "safetensors.torch.save(...) or name the file otherwise") from None


def _plain_path(name: object) -> bool:
    """True for a file name inside the checkpoint folder: ``/``-separated plain names (no empty,
    hidden, ``..``, backslash or NUL part)."""
    return isinstance(name, str) and all(seg and not seg.startswith(".") and "\\" not in seg and "\x00" not in seg
                                         for seg in name.split("/"))


_TOP = {"overwrite", "weights", "extra_files", "metadata", "step", "on_commit", "io", "consistency",
        "local_keys", "commit", "timeout_s"}
