"""The storage layer's file primitives (fastckpt/storage/io.py) that export and the KV store write through."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from fastckpt.storage import ALIGN, FileWriter, buffer_address, copy_file, fsync_dir, get_backend


def test_buffer_address_of_writable_readonly_and_sliced_buffers():
    raw = bytearray(64)
    mv = memoryview(raw)
    assert buffer_address(mv) == ctypes.addressof(ctypes.c_char.from_buffer(mv))
    assert buffer_address(mv[8:]) - buffer_address(mv) == 8
    assert buffer_address(memoryview(b"read-only")) > 0
    assert buffer_address(memoryview(np.zeros((4, 4)).T)) == -1  # not contiguous


@pytest.mark.parametrize("shift", [0, 1])
def test_file_writer_o_direct_with_aligned_and_unaligned_buffers(tmp_path, shift):
    """An unaligned buffer goes through the buffered fd (no O_DIRECT attempt); bytes are exact either way."""
    n = 3 * ALIGN + 100
    m = mmap.mmap(-1, n + ALIGN)  # page aligned
    data = np.random.default_rng(shift).integers(0, 256, n, dtype=np.uint8)
    mv = memoryview(m)[shift:shift + n]
    mv[:] = data.tobytes()
    assert (buffer_address(mv) % ALIGN == 0) == (shift == 0)
    path = tmp_path / "f.bin"
    w = FileWriter(get_backend(None), str(path), ALIGN + n, o_direct=True)
    try:
        w.write(memoryview(b"h" * ALIGN), 0)
        w.write(mv, ALIGN)
        w.sync()
    finally:
        w.close()
    mv.release()
    m.close()
    assert path.read_bytes() == b"h" * ALIGN + data.tobytes()


def test_copy_file_is_exact_and_refuses_to_overwrite(tmp_path):
    src = tmp_path / "src.bin"
    payload = os.urandom((9 << 20) + 123)  # more than one 8 MiB piece of the fallback path
    src.write_bytes(payload)
    assert copy_file(str(src), str(tmp_path / "dst.bin")) == len(payload)
    assert (tmp_path / "dst.bin").read_bytes() == payload
    with pytest.raises(FileExistsError):
        copy_file(str(src), str(tmp_path / "dst.bin"))
    (tmp_path / "empty").write_bytes(b"")
    assert copy_file(str(tmp_path / "empty"), str(tmp_path / "empty2"), fsync=False) == 0


def test_copy_file_falls_back_to_read_write(tmp_path, monkeypatch):
    def refuse(*a, **kw):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    payload = os.urandom((8 << 20) + 5)
    (tmp_path / "a").write_bytes(payload)
    assert copy_file(str(tmp_path / "a"), str(tmp_path / "b")) == len(payload)
    assert (tmp_path / "b").read_bytes() == payload


def test_fsync_dir_tolerates_file_systems_that_refuse_it(tmp_path, monkeypatch):
    real = os.fsync
    calls = []

    def refuse(fd):
        calls.append(fd)
        raise OSError(errno.EINVAL, "not supported")

    monkeypatch.setattr(os, "fsync", refuse)
    fsync_dir(str(tmp_path))  # EINVAL: nothing to flush, no error
    assert calls

    def eio(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError) as ei:
        fsync_dir(str(tmp_path))
    assert ei.value.errno == errno.EIO
    monkeypatch.setattr(os, "fsync", real)


def _mount_types() -> dict[str, str]:
    """mount point -> file system type, from /proc/mounts (a second source beside mountinfo)."""
    with open("/proc/mounts") as f:
        return {p[1]: p[2] for p in (line.split() for line in f) if len(p) > 2}


@pytest.mark.skipif(not os.path.exists("/proc/mounts"), reason="needs Linux /proc")
def test_fs_type_names_the_file_system_of_a_path(tmp_path):
    from fastckpt.storage.io import fs_type, memory_backed

    mounts = _mount_types()
    if mounts.get("/dev/shm") == "tmpfs":
        assert fs_type("/dev/shm") == "tmpfs" and memory_backed("/dev/shm")
    # tmp_path's type is the one of the longest mount point above it
    real = os.path.realpath(tmp_path)
    mp = max((m for m in mounts if real == m or real.startswith(m.rstrip("/") + "/")), key=len)
    assert fs_type(str(tmp_path)) == mounts[mp]
    assert memory_backed(str(tmp_path)) == (mounts[mp] in ("tmpfs", "ramfs", "hugetlbfs"))
    # a file written sparse (set_size) has its size and no allocated blocks until written
    be = get_backend(None)
    w = FileWriter(be, str(tmp_path / "sparse"), 1 << 20, create=True, preallocate=False)
    w.close()
    st = os.stat(tmp_path / "sparse")
    assert st.st_size == 1 << 20 and st.st_blocks * 512 < 1 << 20
