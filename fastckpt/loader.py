"""load: validate everything, then read in parallel straight into the destination tensors.

Reads are planned from the validated headers (:mod:`fastckpt.resolve`): each large
tensor is read in ``chunk_bytes`` pieces directly into its own huge-page-backed host
buffer; runs of adjacent small tensors are read with one ``preadv`` into their buffers.
A thread pool keeps ``threads`` requests in flight (``os.preadv`` releases the GIL), with
no mmap and no page-fault reading. Peak memory is the loaded state plus nothing sized by
the file beyond it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import xxhash

from .dtypes import str_to_dtype
from .errors import ChecksumMismatchError, CheckpointNotFoundError
from .format import TensorInfo
from .io import PosixBackend, get_backend, readv_exact
from .memory import host_buffer
from .resolve import Resolved, resolve
from .saver import DEFAULT_CHUNK_BYTES, default_threads
from .tree import key_filter, unflatten

SMALL_BYTES = 1 << 20


@dataclass
class _Dest:
    key: str
    file: str
    info: TensorInfo
    abs_offset: int
    tensor: torch.Tensor
    view: memoryview


def _alloc(key: str, file: str, info: TensorInfo, data_offset: int) -> _Dest:
    dtype = str_to_dtype(info.dtype, tensor=key, path=file)
    u8, mv = host_buffer(info.nbytes)
    t = u8.view(dtype).view(info.shape) if info.nbytes else torch.empty(info.shape, dtype=dtype)
    return _Dest(key, file, info, data_offset + info.start, t, mv)


def _requests(dests: list[_Dest], chunk: int) -> list[tuple[str, int, list[memoryview], str]]:
    """Group destinations into read requests ``(file, offset, buffers, what)``."""
    reqs: list[tuple[str, int, list[memoryview], str]] = []
    run: list[_Dest] = []

    def flush() -> None:
        if run:
            reqs.append((run[0].file, run[0].abs_offset, [d.view for d in run], run[0].key))
            run.clear()

    for d in sorted(dests, key=lambda d: (d.file, d.abs_offset)):
        n = d.info.nbytes
        if n == 0:
            continue
        if n >= SMALL_BYTES:
            flush()
            for a in range(0, n, chunk):
                reqs.append((d.file, d.abs_offset + a, [d.view[a:a + chunk]], d.key))
            continue
        if run and (run[-1].file != d.file or run[-1].abs_offset + run[-1].info.nbytes != d.abs_offset
                    or sum(len(x.view) for x in run) + n > chunk or len(run) >= 512):
            flush()
        run.append(d)
    flush()
    return reqs


def read_tensors(r: Resolved, keys: Iterable[str], *, threads: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, io_backend: str | PosixBackend | None = None,
                 verify: bool = False) -> dict[str, torch.Tensor]:
    """Read the stored tensors ``keys`` of a resolved checkpoint into new CPU tensors.

    Returns:
        key -> CPU tensor owning its memory, exact dtype and shape from the header.

    Raises:
        CorruptCheckpointError: a file is shorter than its header says.
        ChecksumMismatchError: with ``verify``, a tensor's xxh3 differs from the manifest.
        OSError: from the backend (EIO...).
    """
    be = get_backend(io_backend)
    dests = []
    for k in keys:
        fname, info = r.tensors[k]
        dests.append(_alloc(k, r.file_path(fname), info, r.headers[fname].data_offset))
    reqs = _requests(dests, chunk_bytes)
    fds: dict[str, int] = {}
    try:
        for d in dests:
            if d.file not in fds:
                fds[d.file] = be.open_read(d.file)
        with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="fastckpt-read") as ex:
            futs = [ex.submit(readv_exact, be, fds[f], bufs, off, path=f, what=w) for f, off, bufs, w in reqs]
            for fu in futs:
                fu.result()
            if verify and r.manifest is not None:
                list(ex.map(lambda d: _check(d, r.manifest["tensors"][d.key].get("xxh3")), dests))
    finally:
        for fd in fds.values():
            be.close(fd)
    return {d.key: d.tensor for d in dests}


def _check(d: _Dest, want: str | None) -> None:
    got = xxhash.xxh3_64(d.view).hexdigest()
    if want is not None and got != want:
        raise ChecksumMismatchError(f"{d.file}: tensor {d.key!r} has xxh3 {got}, manifest says {want}",
                                    path=d.file, tensor=d.key)


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu", keys: Any = None,
         threads: int | None = None, verify: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         io_backend: str | PosixBackend | None = None) -> dict:
    """Load a checkpoint, HF model folder or safetensors file.

    Args:
        path: a committed fastckpt checkpoint folder (returns the saved nested structure),
            an HF folder with ``*.safetensors.index.json`` or ``*.safetensors`` files, or one
            safetensors file (both return a flat ``{tensor name: tensor}`` dict).
        device: where tensors end up (``"cpu"`` default; ``"cuda:N"``/``"npu:N"`` stream through
            a bounded ring of pinned host buffers, see :mod:`fastckpt.device_load`).
        keys: a key path / tensor name or a list of them; prefixes select subtrees
            (``"optimizer"`` selects ``optimizer/state/0/exp_avg``). ``None``: everything.
        threads: reads in flight (default :func:`fastckpt.saver.default_threads`).
        verify: also check each tensor's xxh3 against the manifest (fastckpt checkpoints).
        chunk_bytes: bytes per read request (default 8 MiB).
        io_backend: I/O backend name or instance (default ``"posix"``).

    Returns:
        ``dict``: tensors own their memory (no mmap, no shared buffer between tensors
        that did not share storage when saved).

    Raises:
        CheckpointNotFoundError: nothing committed or loadable at ``path``.
        HeaderError, CorruptCheckpointError, ChecksumMismatchError, UnsafePathError:
            invalid or damaged files (before any tensor memory is allocated, except checksums).
        KeyError: for a foreign file or folder, ``keys`` matches no tensor name.
    """
    r = resolve(path)
    keep = key_filter(keys)
    if r.manifest is None:
        names = [n for n in r.tensors if keep is None or keep(n)]
        _check_keys_found(keys, names, r.root)
        out = _read(r, names, device, threads=threads, chunk_bytes=chunk_bytes, io_backend=io_backend)
        return {n: _to(out[n], device) for n in names}
    entries = r.manifest["tensors"]
    wanted = [k for k in entries if keep is None or keep(k)]
    stored = set()
    for k in wanted:
        e = entries[k]
        target = e.get("alias") or e.get("view") or k
        stored.add(target)
    raw = _read(r, sorted(stored), device, threads=threads, chunk_bytes=chunk_bytes, io_backend=io_backend,
                       verify=verify)
    raw = {k: _to(t, device) for k, t in raw.items()}

    def get(key: str, kind: str) -> Any:
        e = entries[key]
        if "alias" in e:
            t = raw[e["alias"]]
        elif "view" in e:
            blob = raw[e["view"]]
            dt = str_to_dtype(e["dtype"], tensor=key, path=r.root)
            isz = torch.empty((), dtype=dt).element_size()
            base = blob.storage_offset() + e["offset"]
            t = torch.empty(0, dtype=dt, device=blob.device).set_(
                blob.untyped_storage(), base // isz, e["shape"], e["stride"])
        else:
            t = raw[key]
        return t.numpy() if kind == "ndarray" else t

    return unflatten(r.skeleton, get, keep)


def _check_keys_found(keys: Any, found: list[str], root: str) -> None:
    if keys is not None and not found:
        raise KeyError(f"{root}: no tensor matches keys={keys!r}")


def _read(r: Resolved, keys: list[str], device: str | torch.device, **opts: Any) -> dict[str, torch.Tensor]:
    """CPU: :func:`read_tensors` straight into the final tensors; other devices: the bounce ring."""
    if torch.device(device).type == "cpu":
        return read_tensors(r, keys, **opts)
    from .device_load import load_tensors  # issue 4: pinned ring / kvikio / NPU streams
    opts.pop("chunk_bytes", None)
    return load_tensors(r, keys, device, **opts)


def _to(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type == "cpu":
        return t
    return t.to(dev)


def open_checkpoint(path: str | os.PathLike) -> Resolved:
    """Validate ``path`` and return its :class:`~fastckpt.resolve.Resolved` description (no data read).

    Raises:
        CheckpointNotFoundError, HeaderError, CorruptCheckpointError: as :func:`load`.
    """
    try:
        return resolve(path)
    except FileNotFoundError as e:
        if isinstance(e, CheckpointNotFoundError):
            raise
        raise CheckpointNotFoundError(str(e)) from e
