"""Write HF sharded safetensors folders with parallel large I/O, and warm the page cache.

:func:`plan_shards` (pure) assigns tensors to ``model.safetensors`` (one file) or
``model-0000k-of-0000n.safetensors`` files, named as ``save_pretrained`` names them;
:func:`write_shards` streams the tensors in batches of at most ``batch_bytes`` (the next batch
is fetched while the current one is written) and writes each batch with parallel ``pwrite``
in ``chunk_bytes`` requests, through the storage layer (:class:`fastckpt.storage.io.FileWriter`
per file, fsynced; the index by :meth:`fastckpt.storage.store.Store.write_file`). The caller
makes the folder visible (``fastckpt load --to`` writes into
:func:`fastckpt.storage.commit.make_temp_dir` and renames it with
:func:`~fastckpt.storage.commit.commit_dir`). :func:`warm_files` reads files with parallel sequential reads so
that an mmap-based loader started next finds every page in memory. :func:`copy_checked` copies a
file while hashing the byte ranges a manifest lists (header, tensors, or the whole file), and
:func:`warm_files` can check the same ranges while it reads: in both the checksums are computed
on the bytes as they are read, never in a second pass.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import xxhash

from ..errors import ChecksumMismatchError, CorruptCheckpointError

from ..format.layout import shard_file_names
from ..format.safetensors import encode_header, write_index
from ..format.manifest import RangeCheck
from ..storage.store import LOCAL
from ..storage.io import DEFAULT_CHUNK_BYTES, FileWriter, default_threads, get_backend, group_by_bytes, read_exact
from ..storage.memory import bytes_view
from ..storage.tier import CheckpointWrites, tier_for

#: ``(name, safetensors dtype string, shape, nbytes)`` of one tensor to write.
Entry = tuple[str, str, tuple[int, ...], int]
#: Called with the byte count each time bytes are read or written (progress bars).
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ShardPlan:
    """Output files: ``files[i]`` is ``(file name, entries in file order)``; ``stem`` names the index."""

    files: tuple[tuple[str, tuple[Entry, ...]], ...]
    stem: str = "model"

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name (the HF index ``weight_map``)."""
        return {e[0]: f for f, es in self.files for e in es}

    @property
    def total_bytes(self) -> int:
        """Tensor data bytes over all files."""
        return sum(e[3] for _, es in self.files for e in es)


def plan_shards(entries: list[Entry], max_shard_bytes: int, stem: str = "model") -> ShardPlan:
    """Split ``entries`` (kept in order) into files of at most ``max_shard_bytes`` data bytes.

    A tensor larger than ``max_shard_bytes`` gets a file of its own. One file is named
    ``{stem}.safetensors``; more are ``{stem}-0000k-of-0000n.safetensors`` (HF naming,
    :func:`fastckpt.format.layout.shard_file_names`).

    Raises:
        ValueError: ``max_shard_bytes`` is not positive.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    groups = group_by_bytes(entries, max_shard_bytes)
    n = len(groups)
    names = shard_file_names(stem, n)
    return ShardPlan(tuple((nm, tuple(g)) for nm, g in zip(names, groups)), stem)


def _batches(entries: tuple[Entry, ...], batch_bytes: int) -> list[list[Entry]]:
    return [b for b in group_by_bytes(entries, batch_bytes) if b]


def write_shards(plan: ShardPlan, fetch: Callable[[list[str]], dict[str, torch.Tensor]], folder: str, *,
                 threads: int | None = None, batch_bytes: int = 1 << 30, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: Progress | None = None, metadata: dict[str, str] | None = None,
                 tier: CheckpointWrites | None = None) -> int:
    """Write the files of ``plan`` (and the index when there are several) into ``folder``.

    Args:
        plan: from :func:`plan_shards`.
        fetch: names -> CPU tensors with exactly the planned dtype/shape (called from one
            background thread, one batch ahead of the writes).
        folder: existing folder; the files must not exist.
        threads: parallel writes (default :func:`fastckpt.storage.io.default_threads`).
        batch_bytes: tensor bytes held per batch (default 1 GiB); peak memory ~ 2 batches.
        chunk_bytes: bytes per write request (default 8 MiB).
        progress: called with bytes written.
        metadata: ``__metadata__`` of every file (default ``{"format": "pt"}``, as transformers writes).
        tier: the tier arbiter's claim and pacing of these writes (``Tier.checkpoint(..., cls="models")``),
            settled by the caller once the folder is committed or abandoned. Default: one of its own,
            counted as stored when the files are written.

    Returns:
        Bytes written (headers included).

    Raises:
        ValueError: a fetched tensor's size differs from the plan. OSError: from the writes.
    """
    be = get_backend(None)
    meta = {"format": "pt"} if metadata is None else metadata
    work = [(fname, b) for fname, es in plan.files for b in (_batches(es, batch_bytes) or [[]])]
    written = 0
    own = tier is None  # the caller's claim is settled by the caller (after its own checks and commit)
    if own:
        tier = tier_for(folder).checkpoint(folder, plan.total_bytes, cls="models")  # the tier's budget and pacing
    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="fastckpt-export") as io, \
            ThreadPoolExecutor(1, thread_name_prefix="fastckpt-fetch") as fetcher:
        nxt = fetcher.submit(fetch, [e[0] for e in work[0][1]]) if work else None
        writers: dict[str, tuple[FileWriter, dict]] = {}
        try:
            for wi, (fname, batch) in enumerate(work):
                tensors = nxt.result()
                nxt = fetcher.submit(fetch, [e[0] for e in work[wi + 1][1]]) if wi + 1 < len(work) else None
                if fname not in writers:
                    entries = list(dict(plan.files)[fname])
                    prefix, infos = encode_header(entries, meta)
                    size = len(prefix) + (infos[-1].end if infos else 0)
                    w = LOCAL.open_write(os.path.join(folder, fname), size, backend=be)
                    w.write(memoryview(prefix), 0)
                    written += len(prefix)
                    writers[fname] = (w, {i.name: len(prefix) + i.start for i in infos})
                w, offs = writers[fname]
                futs = []
                for name, _, _, nbytes in batch:
                    t = tensors[name].contiguous()
                    if t.numel() * t.element_size() != nbytes:
                        raise ValueError(f"tensor {name!r}: fetched {t.numel() * t.element_size()} bytes, "
                                         f"planned {nbytes}")
                    mv = memoryview(bytes_view(t).numpy()) if nbytes else memoryview(b"")
                    for a in range(0, nbytes, chunk_bytes):
                        futs.append(io.submit(_write, w, mv[a:a + chunk_bytes], offs[name] + a, progress, tier.write))
                for f in futs:
                    f.result()
                written += sum(e[3] for e in batch)
                if wi + 1 == len(work) or work[wi + 1][0] != fname:
                    w.sync()
                    w.close()
            if own:
                tier.done(stored=True)
        finally:
            if own:
                tier.done(stored=False)  # no-op after the line above
            for w, _ in writers.values():
                w.close()
            if nxt is not None:
                nxt.cancel()
    if len(plan.files) > 1:
        idx = write_index(plan.weight_map(), plan.total_bytes,
                          sum(math.prod(e[2]) for _, es in plan.files for e in es))
        LOCAL.write_file(os.path.join(folder, f"{plan.stem}.safetensors.index.json"), idx)
        written += len(idx)
    return written


def _write(w: FileWriter, data: memoryview, offset: int, progress: Progress | None,
           paced: Callable[[int], Any]) -> None:
    with paced(len(data)):  # the tier arbiter's pacing (latency-critical reads first)
        w.write(data, offset)
    if progress is not None:
        progress(len(data))


class _RangeHasher:
    """Feeds the bytes of one file, read front to back, to the xxh3 of every :class:`~fastckpt.format.manifest.RangeCheck` range."""

    def __init__(self, path: str, checks: Sequence[RangeCheck]):
        self.path = path
        self.todo = sorted(checks, key=lambda c: (c.start, c.end))
        self.next = 0
        self.active: list[tuple[RangeCheck, "xxhash.xxh3_64"]] = []

    def feed(self, data: memoryview, offset: int) -> None:
        """Hash ``data`` (bytes ``[offset, offset + len(data))`` of the file; calls in file order)."""
        end = offset + len(data)
        while self.next < len(self.todo) and self.todo[self.next].start < end:
            self.active.append((self.todo[self.next], xxhash.xxh3_64()))
            self.next += 1
        done = []
        for c, h in self.active:
            a, b = max(c.start, offset), min(c.end, end)
            if a < b:
                h.update(data[a - offset:b - offset])
            if c.end <= end:
                done.append((c, h))
        for c, h in done:
            self.active.remove((c, h))
            self._compare(c, h)

    def finish(self) -> None:
        """Compare what is left (empty ranges, ranges past the bytes fed)."""
        self.feed(memoryview(b""), 1 << 62)

    def _compare(self, c: RangeCheck, h: "xxhash.xxh3_64") -> None:
        got = h.hexdigest()
        if got != c.xxh3:
            raise ChecksumMismatchError(f"{self.path}: {c.what} (bytes {c.start}-{c.end}) has xxh3 {got}, manifest "
                                        f"says {c.xxh3}: the file is damaged; refusing to use it", path=self.path)


def copy_checked(src: str, dst: str, size: int, checks: Sequence[RangeCheck], *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Copy file ``src`` (``size`` bytes) to the new file ``dst``, hashing ``checks`` on the way.

    Each chunk is read once into a buffer, hashed into every range it overlaps and written from
    that same buffer, so the bytes written are the bytes checked; the next chunk is read while
    one is hashed and written (memory: two ``chunk_bytes`` buffers). ``dst`` is fsynced.

    Returns:
        Bytes copied.

    Raises:
        CorruptCheckpointError: ``src`` is not ``size`` bytes long.
        ChecksumMismatchError: a range's xxh3 differs (``dst`` is then partial: write into a
            temporary folder and discard it).
        OSError: from the reads or writes.
    """
    be = get_backend(None)
    hasher = _RangeHasher(src, checks)
    fd = be.open_read(src)
    try:
        actual = be.size(fd)
        if actual != size:
            raise CorruptCheckpointError(f"{src}: {actual} bytes on disk, manifest says {size} (truncated or "
                                         "replaced)", path=src)
        w = LOCAL.open_write(dst, size, backend=be)
        try:
            bufs = [memoryview(bytearray(min(chunk_bytes, max(size, 1)))) for _ in range(2)]
            spans = [(i, a, min(chunk_bytes, size - a)) for i, a in enumerate(range(0, size, chunk_bytes))]

            def read(span: tuple[int, int, int]) -> memoryview:
                i, a, m = span
                read_exact(be, fd, bufs[i % 2][:m], a, path=src)
                return bufs[i % 2][:m]

            with ThreadPoolExecutor(1, thread_name_prefix="fastckpt-copy") as reader:
                nxt = reader.submit(read, spans[0]) if spans else None
                for i, a, m in spans:  # read chunk i + 1 while chunk i is hashed and written
                    data = nxt.result()
                    nxt = reader.submit(read, spans[i + 1]) if i + 1 < len(spans) else None
                    hasher.feed(data, a)
                    w.write(data, a)
            hasher.finish()
            w.sync()
        finally:
            w.close()
    finally:
        be.close(fd)
    return size


def read_checked(path: str, size: int | None, checks: Sequence[RangeCheck]) -> bytes:
    """Read the file ``path`` (a small file, or a header), hashing ``checks`` on the bytes read.

    Args:
        size: the file's expected size (all of it is read); ``None``: read only up to the end
            of the last range (a safetensors header), whatever the file's size.

    Raises:
        CorruptCheckpointError: not ``size`` bytes (or shorter than the ranges). ChecksumMismatchError:
            a range differs.
    """
    want = size if size is not None else max((c.end for c in checks), default=0)
    data = LOCAL.read_bytes(path, None if size is not None else want)
    if len(data) != want:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes on disk, manifest says "
                                     f"{'' if size is not None else 'at least '}{want} (truncated or replaced)",
                                     path=path)
    h = _RangeHasher(path, checks)
    h.feed(memoryview(data), 0)
    h.finish()
    return data


def warm_files(paths: list[str], *, threads: int | None = None, range_bytes: int = 64 << 20,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
               checks: dict[str, Sequence[RangeCheck]] | None = None) -> int:
    """Read every byte of ``paths`` into the page cache with parallel sequential reads.

    Each file is cut into ``range_bytes`` ranges (default 64 MiB); each worker reads one range
    front to back in ``chunk_bytes`` requests into its own buffer (data discarded). Memory:
    ``threads * chunk_bytes``. With ``checks`` (path -> :class:`~fastckpt.format.manifest.RangeCheck` ranges, e.g. a file's
    header and tensors), each checked range is one job whose bytes are hashed as they are read,
    and the bytes no range covers are warmed as above: still one read of every byte.

    Returns:
        Bytes read.

    Raises:
        OSError: a file cannot be read. CorruptCheckpointError: a file shrank while read.
        ChecksumMismatchError: a checked range differs from its checksum (names file and range).
    """
    be = get_backend(None)
    jobs: list[tuple[str, int, int, RangeCheck | None]] = []
    for p in paths:
        size = LOCAL.size(p)
        pos = 0
        for c in sorted((checks or {}).get(p, ()), key=lambda c: (c.start, c.end)):
            jobs += [(p, a, min(range_bytes, c.start - a), None) for a in range(pos, c.start, range_bytes)]
            jobs.append((p, c.start, c.end - c.start, c))
            pos = max(pos, c.end)
        jobs += [(p, a, min(range_bytes, size - a), None) for a in range(pos, size, range_bytes)]

    def run(job: tuple[str, int, int, RangeCheck | None]) -> int:
        path, start, n, check = job
        hasher = _RangeHasher(path, [check]) if check else None
        fd = be.open_read(path)
        try:
            be.advise_sequential(fd, start, n)
            buf = memoryview(bytearray(max(1, min(chunk_bytes, n))))
            for a in range(0, n, chunk_bytes):
                m = min(chunk_bytes, n - a)
                read_exact(be, fd, buf[:m], start + a, path=path)
                if hasher is not None:
                    hasher.feed(buf[:m], start + a)
                if progress is not None:
                    progress(m)
            if hasher is not None:
                hasher.finish()
        finally:
            be.close(fd)
        return n

    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="fastckpt-warm") as ex:
        return sum(ex.map(run, jobs))
