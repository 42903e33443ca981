"""verify: re-read every byte of a committed checkpoint against its manifest checksums."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FastCkptError, UnsafePathError
from ..format.safetensors import safe_join
from ..storage.io import get_backend, read_exact
from ..tier import tier_for
from ..storage.commit import MANIFEST, read_manifest
from ..format.dtypes import itemsize, str_to_dtype
from .chunks import chunk_boxes
from .regions import Stored, box_runs
from .resolve import Resolved, resolve
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


def _chunk_jobs(path: str, key: str, e: dict) -> list[tuple[str, str, list[tuple[int, int]], int, str]]:
    """One job per format-v2 chunk of tensor entry ``e``: the chunk's byte runs in row-major order."""
    fpath = safe_join(path, e["file"])
    isz = itemsize(str_to_dtype(e["dtype"], tensor=key, path=fpath))
    shape = tuple(e["shape"])
    whole = Stored(key, fpath, e["offsets"][0], shape, e["dtype"], isz, (0,) * len(shape))
    jobs = []
    for box, want in chunk_boxes(key, e, os.path.join(path, MANIFEST)):
        runs = [(r.file_offset, r.nbytes) for r in box_runs(whole, box, box)]
        what = f"tensor {key!r} chunk at offsets {list(box[0])} of shape {list(box[1])} in {e['file']!r}"
        jobs.append((what, fpath, runs, sum(n for _, n in runs), want))
    return jobs


def _jobs(path: str, manifest: dict) -> list[tuple[str, str, list[tuple[int, int]], int, str]]:
    """``(what, file path, byte runs, nbytes, xxh3)`` for every checksummed range of ``manifest``
    (format 2: one job per chunk of a tensor that has ``"chunks"``)."""
    jobs = []
    for name, info in manifest["files"].items():
        if "xxh3" in info:
            jobs.append((f"file {name!r}", safe_join(path, name), [(0, info["bytes"])], info["bytes"], info["xxh3"]))
        if "header_xxh3" in info:  # header + padding: a flip there can leave valid JSON (e.g. metadata)
            jobs.append((f"header of {name!r}", safe_join(path, name), [(0, info["header_bytes"])],
                         info["header_bytes"], info["header_xxh3"]))
    for key, e in manifest["tensors"].items():
        if "file" not in e:
            continue
        if "chunks" in e and "xxh3" not in e:
            jobs.extend(_chunk_jobs(path, key, e))
            continue
        s, end = e["offsets"]
        jobs.append((f"tensor {key!r} in {e['file']!r}", safe_join(path, e["file"]), [(s, end - s)], end - s, e["xxh3"]))
    return jobs


def verify(path: str | os.PathLike, *, threads: int | None = None,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> VerifyReport:
    """Re-read every file of the committed checkpoint ``path`` and compare checksums.

    Headers and sizes are validated first (see :func:`fastckpt.loading.resolve.resolve`); then each
    tensor's bytes (xxh3-64) and each small file's bytes are hashed in parallel. A format-2 tensor
    written in pieces by several ranks is checked chunk by chunk (``"chunks"``: each chunk's elements in
    row-major order); a problem names the key and the chunk's offsets and shape.

    Args:
        path: checkpoint folder with a manifest.
        threads: parallel readers (default :func:`fastckpt.storage.io.default_threads`).
        chunk_bytes: read size in bytes (default 8 MiB); memory use is ``threads * chunk_bytes``.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is false on any mismatch.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    try:
        r = resolve(path)
    except CheckpointNotFoundError:
        raise
    except FastCkptError as e:  # damaged header/index/manifest, unknown dtype, unsafe path
        report.problems.append(f"{type(e).__name__}: {e}")
        try:  # still re-read every other byte the manifest covers, so every damaged file is named
            r = Resolved(path, manifest=read_manifest(path))
        except (OSError, FastCkptError):
            return report
        if isinstance(e, UnsafePathError):
            return report  # never read through a name that leaves the folder
    if r.manifest is None:
        report.notes.append(f"{path}: no manifest.json (not a fastckpt checkpoint): every header and index "
                            "was validated, but there are no checksums to compare the bytes against")
        return report
    try:
        jobs = _jobs(path, r.manifest)
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

    with ThreadPoolExecutor(threads or default_threads()) as ex:
        for n, problem in ex.map(run, jobs):
            report.bytes_checked += n
            if problem:
                report.problems.append(problem)
    return report
