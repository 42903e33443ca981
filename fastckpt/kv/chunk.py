"""Pieces of the fastckpt KV chunk store: options, counters, open-chunk handle, names, checksums.

See :mod:`.file_store` for the folder layout and the rules; bytes move through the storage
layer (:mod:`fastckpt.storage`). No LMCache import.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import xxhash

FORMAT_TAG = "fastckpt-kv/1"
SUFFIX = ".kv.safetensors"
LOCK_NAME = ".fckv.lock"
HEADER_ALIGN = 4096

@dataclass(frozen=True)
class KVStoreOptions:
    """Options of a :class:`KVFileStore`.

    Attributes:
        path: the shared folder (created if missing).
        max_bytes: capacity of the whole folder in bytes, for all processes together;
            0 means unlimited. Default 0.
        o_direct: read and write the 4096-aligned parts of the data region with
            O_DIRECT when the buffer address is 4096-aligned (LMCache's CPU allocator
            aligns to 4096); falls back to buffered I/O where the file system refuses
            it (tmpfs). Default True.
        durable: fsync each chunk file and its folder before it becomes visible.
            Default True.
        piece_bytes: size of one parallel read and of one checksum piece, in bytes;
            a multiple of 4096. Default 4 MiB.
        verify: check the per-piece checksums on every read. Default True.
        min_rescan_interval_s: least time between two full folder scans done before
            an eviction, in seconds. Default 1.0.
        stale_tmp_s: a temp file of another host older than this is deleted by a scan,
            in seconds (one of this host is deleted when its writer is dead, never while it
            lives). Default 600.
    """

    path: str
    max_bytes: int = 0
    o_direct: bool = True
    durable: bool = True
    piece_bytes: int = 4 << 20
    verify: bool = True
    min_rescan_interval_s: float = 1.0
    stale_tmp_s: float = 600.0

    def __post_init__(self):
        if not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0 (0 = unlimited), got {self.max_bytes!r}")
        if not isinstance(self.piece_bytes, int) or self.piece_bytes <= 0 or self.piece_bytes % 4096:
            raise ValueError(f"piece_bytes must be a positive multiple of 4096, got {self.piece_bytes!r}")


@dataclass
class KVStats:
    """Counters of one process's use of the store (thread-safe through ``lock``).

    Byte counts are chunk data bytes; ``*_s`` are summed wall seconds. ``repairs`` counts the
    times this process found the folder lock left inside a change by a dead process and
    recounted the folder.
    """

    lookup_hits: int = 0
    lookup_misses: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    get_s: float = 0.0
    puts: int = 0
    put_bytes: int = 0
    put_s: float = 0.0
    put_failures: int = 0
    put_skipped: int = 0
    corrupt_dropped: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    rescans: int = 0
    repairs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas) -> None:
        """Add ``deltas`` (counter name -> amount) atomically."""
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        """Return the counters plus derived ``hit_rate`` and ``get_gbps``/``put_gbps`` (GB/s)."""
        with self.lock:
            d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "lock"}
        looked = d["hits"] + d["misses"]
        d["hit_rate"] = d["hits"] / looked if looked else 0.0
        d["get_gbps"] = d["get_bytes"] / d["get_s"] / 1e9 if d["get_s"] else 0.0
        d["put_gbps"] = d["put_bytes"] / d["put_s"] / 1e9 if d["put_s"] else 0.0
        return d


@dataclass
class ChunkHandle:
    """An open, header-validated chunk file ready for :meth:`KVFileStore.read_piece`.

    Attributes:
        name: 32-hex chunk name. path: file path. fd / fd_direct: open descriptors
        (``fd_direct`` is -1 without O_DIRECT). data_offset: absolute offset of the
        data region. groups: ``[(safetensors dtype, shape)]`` per KV group.
        nbytes: data bytes. fmt: LMCache memory-format name. key: LMCache key string.
        piece_bytes / piece_hashes: checksum layout. ino: inode, to drop only this file.
    """

    name: str
    path: str
    fd: int
    fd_direct: int
    data_offset: int
    groups: list
    nbytes: int
    fmt: str
    key: str
    piece_bytes: int
    piece_hashes: list
    ino: int

    def pieces(self) -> list[tuple[int, int]]:
        """``[(start, length)]`` of each piece of the data region, in bytes."""
        return [(s, min(self.piece_bytes, self.nbytes - s)) for s in range(0, self.nbytes, self.piece_bytes)]


def chunk_name(key_string: str) -> str:
    """The file name stem of a key: 32 hex digits of xxh3-128 of ``key_string`` (UTF-8)."""
    return xxhash.xxh3_128_hexdigest(key_string.encode("utf-8"))


def piece_hashes(buf: memoryview, piece_bytes: int) -> list[str]:
    """xxh3-64 hex digest of each ``piece_bytes`` piece of ``buf``."""
    return [xxhash.xxh3_64_hexdigest(buf[s:s + piece_bytes]) for s in range(0, len(buf), piece_bytes)]


def chunk_groups(tensors: dict, nbytes: int, path: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(safetensors dtype, shape)]`` of a chunk file's KV groups, from its header's ``tensors``
    (name -> ``TensorInfo``), checked to be what :meth:`KVFileStore.write` writes: names exactly
    ``kv.0 .. kv.<n-1>``, their bytes back to back in that order over the whole data region of
    ``nbytes``. The piece checksums cover the data only: a flipped header byte that renamed
    ``kv.0`` to ``kv.2`` would otherwise serve the groups in another order over the same bytes.

    Raises:
        ValueError: anything else (the caller treats the file as corrupt: a miss, dropped).
    """
    want = [f"kv.{i}" for i in range(len(tensors))]
    if sorted(tensors) != sorted(want):
        raise ValueError(f"{path}: tensor names {sorted(tensors)[:4]} are not kv.0 .. kv.{len(tensors) - 1}")
    end = 0
    for n in want:
        t = tensors[n]
        if t.start != end:
            raise ValueError(f"{path}: {n} starts at data byte {t.start}, the group before it ends at {end}")
        end = t.end
    if end != nbytes:
        raise ValueError(f"{path}: the groups cover {end} of the {nbytes} data bytes")
    return [(tensors[n].dtype, tuple(tensors[n].shape)) for n in want]
