"""Load tensors into device memory through a bounded ring of (pinned) host bounce buffers.

What is read is planned first (:func:`fastckpt.loading.pieces.plan_pieces`, pure): every needed byte range of every
file becomes a *piece* of at most ``slot_bytes``, with the copies that move its bytes into the
destination tensors (adjacent small tensors share a piece; a tensor-parallel slice reads only
its own byte ranges, see :mod:`fastckpt.loading.tp`). How the bytes move is a small strategy
(:class:`Engine`) chosen by device type from :data:`ENGINES`:

- ``cuda`` / ``npu``: the ring's slots are pinned host buffers; worker threads ``preadv`` pieces
  into free slots, the main thread issues the host-to-device copy of each finished piece on a
  side stream and records an event; a slot is reused only after its event completed, so reads
  of the next pieces overlap the copies. With ``kvikio`` importable, a CUDA device and GDS not
  in compatibility mode, contiguous ranges are read straight into device memory instead.
- ``cpu``: the same ring and code path with synchronous copies (used to test the ring, and for
  dtype conversion / tensor-parallel slices on CPU).

Memory: every destination is allocated once, in its *returned* dtype and shape (the slice's under
a TP split); a dtype conversion runs per copy, from the slot straight into the destination (pieces
cut tensors at element boundaries), so no stored-dtype copy of a tensor ever exists. Peak growth,
``R`` = returned bytes, ``B`` = ring_bytes, ``S`` = slot_bytes: ``cpu`` host ``<= R + B + S``;
``cuda``/``npu`` device ``<= R + S`` (``R`` without conversion); details in :func:`load_tensors`.

Every returned tensor is its own allocation on the device: nothing points into a slot.
GPU/NPU modules are imported lazily.
"""

from __future__ import annotations

import collections
import difflib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import torch
import xxhash

from ..format.dtypes import str_to_dtype
from ..errors import ChecksumMismatchError, KeysNotFoundError
from ..storage.tier import NullTier, tier_for
from ..storage.io import PosixBackend, get_backend, readv_exact
from .resolve import Resolved, resolve
from ..storage.io import default_threads
from .engines import ENGINES, AcceleratorEngine, Engine, check_device, get_engine, kvikio_usable  # noqa: F401  (re-exported)
from .pieces import SEGMENT_MIN_BYTES, Copy, Piece, Target, flat_ranges, plan_pieces  # noqa: F401  (re-exported)
from .tp import Shard, slice_spec
from .chunks import check_chunks

#: Default bounce ring size (bytes) and slot size (bytes).
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_SLOT_BYTES = 16 << 20



def _targets(r: Resolved, keys: Iterable[str], shard: Shard | None) -> list[Target]:
    out = []
    for k in keys:
        fname, info = r.tensors[k]
        dim = shard.dim_for(info.name) if shard is not None and shard.world_size > 1 else None
        sl = slice_spec(info, dim, shard.rank, shard.world_size) if dim is not None else None
        out.append(Target(k, r.file_path(fname), r.headers[fname].data_offset + info.start, info, sl))
    return out


@dataclass(frozen=True)
class _Conv:
    """A target converted on the way: stored dtype -> returned dtype."""

    stored: torch.dtype
    out: torch.dtype


def _conv(t: Target, dtype: torch.dtype | None) -> _Conv | None:
    stored = str_to_dtype(t.info.dtype, tensor=t.key, path=t.file)
    if dtype is not None and stored != dtype and stored.is_floating_point and dtype.is_floating_point:
        return _Conv(stored, dtype)
    return None


def _apply(engine: Engine, c: Copy, dest: torch.Tensor, slot: torch.Tensor, cv: _Conv | None = None) -> None:
    if c.rows == 0:
        src = slot[c.src_off:c.src_off + c.nbytes]
        if cv is None:
            engine.copy(dest[c.dst_off:c.dst_off + c.nbytes], src)
        else:  # dest holds cv.out elements; offsets are in stored bytes (whole elements, see _step)
            isz = cv.stored.itemsize
            e0 = c.dst_off // isz
            engine.convert(dest.view(cv.out)[e0:e0 + c.nbytes // isz], src, cv.stored)
        return
    src = slot[c.src_off:c.src_off + c.rows * c.row_bytes].view(c.rows, c.row_bytes)[:, c.col_off:c.col_off + c.col_bytes]
    if engine.device.type != "cpu":
        src = src.contiguous()  # gather the rank's columns: at most one piece of host scratch
    if cv is None:
        engine.copy(dest[c.dst_off:c.dst_off + c.rows * c.col_bytes].view(c.rows, c.col_bytes), src)
        return
    isz = cv.stored.itemsize
    cols, r0 = c.col_bytes // isz, c.dst_off // c.col_bytes
    engine.convert(dest.view(cv.out)[r0 * cols:(r0 + c.rows) * cols].view(c.rows, cols), src, cv.stored)


class _Ring:
    """Runs a piece plan through ``n_slots`` bounce buffers of ``slot_bytes`` each."""

    def __init__(self, engine: Engine, n_slots: int, slot_bytes: int, threads: int, be: PosixBackend):
        self.engine, self.be = engine, be
        self.slots = [engine.host_slot(slot_bytes) for _ in range(n_slots)]
        self.threads = max(1, min(threads, n_slots))

    def run(self, pieces: list[Piece], dests: list[torch.Tensor],
            hashers: dict[int, "xxhash.xxh3_64"], convs: list[_Conv | None] | None = None, pacer=None) -> None:
        """Read ``pieces`` into the slots and copy them on into ``dests``; ``pacer``: the tier's
        :class:`~fastckpt.storage.tier.LoadPacer` each read runs inside (KV gets go first), or None."""
        pacer = pacer or NullTier._Pacer()
        self.convs = convs or [None] * len(dests)
        n = len(self.slots)
        fds: dict[str, int] = {}
        pending: collections.deque = collections.deque()
        try:
            for p in pieces:
                if p.file not in fds:
                    fds[p.file] = self.be.open_read(p.file)
            self.engine.begin()
            with ThreadPoolExecutor(self.threads, thread_name_prefix="fastckpt-ring") as ex:
                for i, p in enumerate(pieces):
                    s = i % n
                    if len(pending) == n:
                        self._consume(*pending.popleft(), dests, hashers)
                    self.engine.wait(s)
                    mv = self.slots[s][1][:p.nbytes]
                    pending.append((p, s, ex.submit(pacer.run, p.nbytes, readv_exact, self.be, fds[p.file], [mv],
                                                    p.offset, path=p.file, what=f"piece @{p.offset}")))
                while pending:
                    self._consume(*pending.popleft(), dests, hashers)
            self.engine.finish()
        finally:
            for f in pending:
                f[2].cancel()
            for fd in fds.values():
                self.be.close(fd)

    def _consume(self, p: Piece, s: int, fut, dests: list[torch.Tensor], hashers: dict) -> None:
        fut.result()
        slot_t, slot_mv = self.slots[s]
        for c in p.copies:
            h = hashers.get(c.dest)
            if h is not None:
                h.update(slot_mv[c.src_off:c.src_off + c.nbytes])
            _apply(self.engine, c, dests[c.dest], slot_t, self.convs[c.dest])
        self.engine.record(s)


def _kvikio_read(targets: list[Target], dests: list[torch.Tensor], idx: list[int], chunk: int) -> None:
    import kvikio
    futs, files = [], {}
    try:
        for i in idx:
            t = targets[i]
            f = files.get(t.file) or files.setdefault(t.file, kvikio.CuFile(t.file, "r"))
            for fo, do, n in flat_ranges(t):
                for a in range(0, n, chunk):
                    m = min(chunk, n - a)
                    futs.append(f.pread(dests[i][do + a:do + a + m], m, fo + a))
        for fu in futs:
            fu.get()
    finally:
        for f in files.values():
            f.close()


def load_tensors(r: Resolved, keys: Iterable[str], device: str | torch.device, *,
                 dtype: torch.dtype | None = None, shard: Shard | None = None,
                 ring_bytes: int = DEFAULT_RING_BYTES, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 threads: int | None = None, verify: bool = False,
                 io_backend: str | PosixBackend | None = None, use_kvikio: bool | None = None
                 ) -> dict[str, torch.Tensor]:
    """Read tensors ``keys`` of a resolved checkpoint into new tensors on ``device``.

    Peak memory (bytes), with ``R`` the bytes of the returned tensors (``sum(numel * itemsize)`` in
    the returned dtype: the slices under ``shard``, the converted size under ``dtype``),
    ``B = ring_bytes`` and ``S = slot_bytes``:

    - ``device="cpu"``: host memory grows by at most ``R + B + S``;
    - CUDA / NPU: device memory grows by at most ``R + S`` (``R`` when nothing is converted),
      host memory by at most ``(B // S) * P + S``, ``P`` = ``S`` rounded up to a power of two
      (pinned slots come from torch's caching host allocator).

    ``dtype`` is applied per ring piece, from the slot straight into the destination; a tensor
    never exists in its stored dtype on the device. kvikio (GDS) reads add no buffer; they are used
    only for tensors that keep their dtype. The bound is asserted by
    ``tests/loading/test_device_memory.py`` (RSS) and ``scripts/gpu_check.sh`` (CUDA).

    Args:
        r: from :func:`fastckpt.loading.resolve.resolve` (headers validated).
        keys: stored tensor keys (``r.tensors`` keys).
        device: ``"cpu"``, ``"cuda:N"``, ``"npu:N"`` or a type registered in :data:`ENGINES`.
        dtype: convert floating-point tensors to this dtype while loading (``None``: keep).
        shard: tensor-parallel split (:class:`fastckpt.loading.tp.Shard`); only this rank's bytes are read.
        ring_bytes: host bounce memory in bytes (default 256 MiB); at least two slots.
        slot_bytes: bytes per slot and per read (default 16 MiB).
        threads: reads in flight (default :func:`fastckpt.storage.io.default_threads`, at most the slots).
        verify: check each whole (unsliced) tensor's xxh3 against the manifest, if there is one
            (format 2: each chunk's xxh3, for tensors loaded without dtype conversion).
        io_backend: I/O backend name or instance for the ring reads (default ``"posix"``).
        use_kvikio: ``None`` (default) uses kvikio/GDS when :func:`kvikio_usable`; ``False`` never.

    Returns:
        key -> tensor on ``device`` with the stored shape (or the slice's), each its own allocation.

    Raises:
        ValueError: bad sizes, unknown device, or a split that does not divide a dim.
        CorruptCheckpointError: a file is shorter than its header says.
        ChecksumMismatchError: with ``verify``, a tensor's bytes differ from the manifest.
        OSError: from the backend.
    """
    if slot_bytes <= 0 or ring_bytes < 2 * slot_bytes:
        raise ValueError(f"need slot_bytes > 0 and ring_bytes >= 2 * slot_bytes, got ring_bytes={ring_bytes} "
                         f"slot_bytes={slot_bytes}; raise ring_bytes or lower slot_bytes")
    keys = list(keys)
    engine = get_engine(device)
    targets = _targets(r, keys, shard)
    convs = [_conv(t, dtype) for t in targets]
    # each destination is allocated once, in the returned dtype: no stored-dtype twin
    dests = [engine.empty(t.nbytes if cv is None else t.nbytes // cv.stored.itemsize * cv.out.itemsize)
             for t, cv in zip(targets, convs)]
    entries = r.entries() if verify else {}  # one file of a checkpoint: its manifest's checksums too
    want = {i: entries[t.key].xxh3 for i, t in enumerate(targets) if t.slice is None and t.key in entries}
    use_kv = kvikio_usable(engine.device) if use_kvikio is None else use_kvikio
    direct = [i for i, t in enumerate(targets)
              if use_kv and i not in want and convs[i] is None and flat_ranges(t)]
    if direct:
        _kvikio_read(targets, dests, direct, slot_bytes)
    pieces = plan_pieces(targets, slot_bytes, frozenset(direct))
    hashers = {i: xxhash.xxh3_64() for i in want}
    if pieces:
        n_slots = min(ring_bytes // slot_bytes, max(2, len(pieces)))
        ring = _Ring(engine, n_slots, slot_bytes, threads or default_threads(), get_backend(io_backend))
        converting = [p.nbytes for p in pieces if any(convs[c.dest] is not None for c in p.copies)]
        if converting:
            engine.reserve(max(converting))
        tier = tier_for(r.root)
        with tier.reading(sum(p.nbytes for p in pieces)):  # a latency-critical read on the tier; KV gets go first
            ring.run(pieces, dests, hashers, convs, pacer=tier.loader())
    for i, h in hashers.items():
        if want[i] is not None and h.hexdigest() != want[i]:
            t = targets[i]
            raise ChecksumMismatchError(f"{t.file}: tensor {t.key!r} has xxh3 {h.hexdigest()}, manifest says "
                                        f"{want[i]}", path=t.file, tensor=t.key)
    out = {t.key: _finish(t, d, cv) for t, d, cv in zip(targets, dests, convs)}
    for i, t in enumerate(targets):  # format 2: per-chunk checksums of whole, unconverted tensors
        e = entries.get(t.key)
        if e is not None and t.slice is None and convs[i] is None and e.chunks is not None and e.xxh3 is None:
            check_chunks(out[t.key], t.key, e, t.file)
    return out


def _finish(t: Target, raw: torch.Tensor, cv: _Conv | None) -> torch.Tensor:
    """The destination's bytes as the returned tensor (a view: no copy, no conversion here)."""
    dt = cv.out if cv is not None else str_to_dtype(t.info.dtype, tensor=t.key, path=t.file)
    return raw.view(dt).view(t.shape) if raw.numel() else torch.empty(t.shape, dtype=dt, device=raw.device)


def load_weights(path: str | os.PathLike, device: str | torch.device = "cpu", *, keys: Iterable[str] | None = None,
                 dtype: torch.dtype | None = None, shard: Shard | None = None, **options) -> dict[str, torch.Tensor]:
    """Load the flat ``{stored key: tensor}`` of any checkpoint, HF folder or safetensors file.

    ``options`` are those of :func:`load_tensors` (``ring_bytes``, ``slot_bytes``, ``threads``,
    ``verify``, ``io_backend``, ``use_kvikio``). Keys are tensor names for foreign files and key
    paths (``model/...``) for fastckpt checkpoints.

    Peak memory (bytes), as :func:`load_tensors`: with ``R`` the bytes of the returned tensors (in
    the returned dtype, slices under ``shard``), ``B = ring_bytes`` (default 256 MiB) and
    ``S = slot_bytes`` (default 16 MiB), host memory grows by at most ``R + B + S`` on ``"cpu"``;
    on CUDA / NPU device memory grows by at most ``R + S`` and host memory by at most
    ``(B // S) * P + S`` (``P``: ``S`` rounded up to a power of two). A 256 MiB fp32 file loaded
    with ``dtype=torch.bfloat16`` on CPU therefore peaks at 128 MiB + ``B`` + ``S``, never 256 + 128.

    Example::

        w = load_weights("Llama-3-8B/", "cuda:0", dtype=torch.bfloat16,
                         shard=Shard(rank, 2, {"*q_proj.weight": 0, "*o_proj.weight": 1}))

    Raises:
        KeysNotFoundError: a name in ``keys`` is not stored (a ``KeyError``), before any read.
        DeviceUnavailableError: ``device`` cannot be loaded into here (see :func:`check_device`).
        Others as :func:`load_tensors`.
    """
    check_device(device)
    r = resolve(path)
    names = list(r.tensors) if keys is None else list(keys)
    missing = [k for k in names if k not in r.tensors]
    if missing:
        close = difflib.get_close_matches(missing[0], list(r.tensors), n=3)
        raise KeysNotFoundError(f"{r.root}: not stored: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                                + (f"; did you mean {close}?" if close else "") + "; nothing was read",
                                keys=missing, path=str(r.root))
    return load_tensors(r, names, device, dtype=dtype, shard=shard, **options)
