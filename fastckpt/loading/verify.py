"""verify: re-read every byte of a committed checkpoint against its manifest checksums."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, FastCkptError, InvalidArgumentError,
                      NotSafetensorsError, UnsafePathError)
from ..storage.model_files import safe_join
from ..storage.io import get_backend, read_exact
from ..format.manifest import Manifest
from ..storage.locate import is_url, store_for
from ..storage.commit import MANIFEST, read_manifest
from ..storage.store import LOCAL
from ..storage.tier import tier_for
from ..format.dtypes import itemsize, str_to_dtype
from .regions import Stored, box_runs
from .reader import check_threads
from .resolve import Resolved, resolve
from .source import owning_checkpoint
from ..storage.io import DEFAULT_CHUNK_BYTES, default_threads


@dataclass
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        path: the checkpoint folder.
        bytes_checked: bytes re-read and hashed.
        problems: one line per mismatch, naming the file and the tensor.
        notes: what could not be checked (e.g. a foreign HF folder has no checksums).
    """

    path: str
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def _hash_range(path: str, runs: list[tuple[int, int]], chunk: int) -> str:
    """xxh3-64 of the bytes of ``runs`` (``(offset, nbytes)``, in order) of file ``path``."""
    be = get_backend(None)
    h = xxhash.xxh3_64()
    fd = be.open_read(path)
    bg = tier_for(path).background()  # verification yields to latency-critical reads and checkpoint writes
    try:
        buf = bytearray(min(chunk, max(max((n for _, n in runs), default=1), 1)))
        mv = memoryview(buf)
        for offset, nbytes in runs:
            pos = 0
            while pos < nbytes:
                n = min(chunk, nbytes - pos)
                bg.pace(n)
                read_exact(be, fd, mv[:n], offset + pos, path=path)
                h.update(mv[:n])
                pos += n
    finally:
        bg.close()
        be.close(fd)
    return h.hexdigest()


def _owner(path: str) -> tuple[str, set[str]] | None:
    """``(checkpoint folder, absolute paths of the files to check)`` when ``path`` (no manifest of its
    own) is a file of a fastckpt checkpoint or a sub-folder of one (peft's second adapter,
    ``CKPT/second/``, listed by ``CKPT/manifest.json``); None otherwise."""
    if is_url(path):
        return None
    ap = os.path.abspath(path)
    if LOCAL.isfile(ap):
        folder, name = owning_checkpoint(os.path.dirname(ap), os.path.basename(ap))
        if LOCAL.isfile(os.path.join(folder, MANIFEST)):
            return folder, {os.path.abspath(os.path.join(folder, name))}
        return None
    parent = os.path.dirname(ap)
    if LOCAL.isdir(ap) and LOCAL.isfile(os.path.join(parent, MANIFEST)):
        sub = os.path.basename(ap) + "/"
        under = {os.path.abspath(os.path.join(parent, f)) for f in read_manifest(parent).files if f.startswith(sub)}
        if under:
            return parent, under
    return None


def _jobs(path: str, manifest: Manifest) -> list[tuple[str, str, list[tuple[int, int]], int, str]]:
    """``(what, file path, byte runs, nbytes, xxh3)`` for every checksummed range of ``manifest``
    (:meth:`~fastckpt.format.manifest.Manifest.checks`; a format-2 chunk: its byte runs in row-major order)."""
    jobs = []
    for c in manifest.checks():
        fpath = safe_join(path, c.file)
        if c.box is None:
            runs = [(c.start, c.end - c.start)]
        else:
            assert c.key is not None and c.shape is not None and c.dtype is not None
            isz = itemsize(str_to_dtype(c.dtype, tensor=c.key, path=fpath))
            whole = Stored(c.key, fpath, c.start, c.shape, c.dtype, isz, (0,) * len(c.shape))
            runs = [(r.file_offset, r.nbytes) for r in box_runs(whole, c.box, c.box)]
        what = c.what if c.key is None else f"{c.what} in {c.file!r}"
        jobs.append((what, fpath, runs, sum(n for _, n in runs), c.xxh3))
    return jobs


def verify(path: str | os.PathLike, *, threads: int | None = None,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Re-read every file of the committed checkpoint ``path`` and compare checksums.

    Headers and sizes are validated first (see :func:`fastckpt.loading.resolve.resolve`); then each
    tensor's bytes (xxh3-64) and each small file's bytes are hashed in parallel. A format-2 tensor
    written in pieces by several ranks is checked chunk by chunk (``"chunks"``: each chunk's elements in
    row-major order); a problem names the key and the chunk's offsets and shape.

    Args:
        path: checkpoint folder with a manifest (or its URL in a store, ``s3://bucket/prefix``), or one
            safetensors file of it (its ranges only, against the folder's manifest), or a sub-folder /
            a file of a sub-folder its manifest lists (peft's second adapter, ``CKPT/second/``); a folder
            or file of no checkpoint: headers and index validated, a note says there is nothing to compare.
        threads: parallel readers (default :func:`fastckpt.storage.io.default_threads`).
        chunk_bytes: read size in bytes (default 8 MiB); memory use is ``threads * chunk_bytes``.
        progress: called as ``progress(bytes_done, bytes_total)`` (cumulative, in bytes) once before
            the first read and after each checksummed range (from the calling thread), e.g. to
            drive a progress bar (``fastckpt verify`` does); not called where nothing is re-read.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is false on any mismatch.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        NotSafetensorsError: ``path`` is a file of another format (a ``torch.save`` file, a pickle,
            JSON) outside any checkpoint (inside one, a shard replaced by such a file is a problem of
            the report).
    """
    path = InvalidArgumentError.check_path(path)
    check_threads(threads)
    if is_url(path):  # a non-local store (s3://...): verify a local copy of every byte
        with store_for(path).local_folder(path) as local:
            rep = verify(local, threads=threads, chunk_bytes=chunk_bytes)
        rep.problems = [p.replace(local, path) for p in rep.problems]
        rep.path = path
        return rep
    path = os.fspath(path)
    report = VerifyReport(path)
    try:
        r = resolve(path, values=False)  # state.json is one of the files re-read below
    except CheckpointNotFoundError:
        raise
    except FastCkptError as e:  # damaged header/index/manifest, unknown dtype, unsafe path
        if isinstance(e, NotSafetensorsError) and LOCAL.isfile(path) and not LOCAL.exists(
                os.path.join(os.path.dirname(os.path.abspath(path)), MANIFEST)):
            raise  # the file asked for is another format (a torch.save file...): not a damaged checkpoint
        report.problems.append(f"{type(e).__name__}: {e}")
        try:  # still re-read every other byte the manifest covers, so every damaged file is named
            r = Resolved(path, manifest=read_manifest(path))
        except (OSError, FastCkptError):
            return report
        if isinstance(e, UnsafePathError):
            return report  # never read through a name that leaves the folder
    only = None  # files of a fastckpt checkpoint: their ranges, checked against the checkpoint's manifest
    if r.manifest is None:
        owner = _owner(path)
        if owner is not None:
            path, only = owner
            r = Resolved(path, manifest=read_manifest(path))
    if r.manifest is None:
        report.notes.append(f"{path}: no manifest.json (not a fastckpt checkpoint): every header and index "
                            "was validated, but there are no checksums to compare the bytes against")
        return report
    try:
        jobs = _jobs(path, r.manifest)
        if only is not None:
            jobs = [j for j in jobs if os.path.abspath(j[1]) in only]
            if not jobs:
                report.notes.append(f"{', '.join(sorted(only))}: not a file of the checkpoint {path} (its "
                                    "manifest.json does not list it): its header was validated, nothing to "
                                    "compare its bytes against")
                return report
    except (KeyError, TypeError, ValueError, AttributeError) as ex:  # malformed entries (named by resolve)
        if not report.problems:
            report.problems.append(f"{path}: malformed manifest entry: {type(ex).__name__}: {ex}")
        return report

    def run(job):
        what, fpath, runs, n, want = job
        try:
            got = _hash_range(fpath, runs, chunk_bytes)
        except (OSError, CorruptCheckpointError) as ex:
            return n, f"{what}: cannot read: {ex}"
        return n, (None if got == want else f"{what}: xxh3 {got} != manifest {want} ({fpath})")

    total = sum(job[3] for job in jobs)
    if progress is not None:
        progress(0, total)
    with ThreadPoolExecutor(threads or default_threads()) as ex:
        for n, problem in ex.map(run, jobs):
            report.bytes_checked += n
            if progress is not None:
                progress(report.bytes_checked, total)
            if problem:
                report.problems.append(problem)
    return report
