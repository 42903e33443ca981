"""KVFileStore (the storage half of the LMCache backend): case C8 and multi-process sharing.

No LMCache needed. Chunks are [2, layers, 256 tokens, heads*head_dim] bf16, kept small.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import subprocess
import threading
import uuid

import pytest
import torch
from safetensors.torch import load_file

from fastckpt.errors import CorruptCheckpointError, InsufficientSpaceError
from fastckpt.kv import KVFileStore, KVStoreOptions, chunk_name
from fastckpt.kv.folder_index import TMP_RE

SHAPE = (2, 2, 256, 128)  # 2 * 2 * 256 * 128 * 2 bytes = 256 KiB per chunk
PIECE = 64 << 10


def _chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16)


def _put(store: KVFileStore, seed: int) -> str:
    t = _chunk(seed)
    key = f"model@1@0@{seed:x}@bfloat16"
    buf = memoryview(t.view(torch.uint8).numpy()).cast("B")
    store.write(chunk_name(key), key, "KV_2LTD", [("BF16", SHAPE, len(buf))], buf)
    return chunk_name(key)


def _get(store: KVFileStore, name: str) -> torch.Tensor | None:
    """Read a chunk the way the backend does (all pieces); None on a miss or bad file."""
    h = store.open_chunk(name)
    if h is None:
        return None
    out = torch.empty(h.nbytes, dtype=torch.uint8)
    mv = memoryview(out.numpy()).cast("B")
    try:
        for s, n in h.pieces():
            store.read_piece(h, mv, s, n)
    except CorruptCheckpointError as e:
        store.drop_corrupt(h, str(e))
        return None
    finally:
        store.close_chunk(h)
    return out.view(torch.bfloat16).view(SHAPE)


def _store(path, **kw) -> KVFileStore:
    kw.setdefault("piece_bytes", PIECE)
    return KVFileStore(KVStoreOptions(path=str(path), **kw))


def _files(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f != ".fckv.lock")


def test_roundtrip_is_a_standard_safetensors_file(tmp_path):
    st = _store(tmp_path)
    name = _put(st, 1)
    assert torch.equal(_get(st, name), _chunk(1))
    (path,) = _files(tmp_path)
    assert path.endswith(name + ".kv.safetensors")
    assert torch.equal(load_file(path)["kv.0"], _chunk(1))  # the safetensors package reads it
    assert (os.path.getsize(path) - 256 * 1024) % 4096 == 0  # header padded for O_DIRECT
    assert st.used_bytes() == st.disk_bytes() == os.path.getsize(path)


def test_get_while_put_in_flight_is_a_miss_and_nothing_partial_is_visible(tmp_path, monkeypatch):
    st = _store(tmp_path)
    started, release = threading.Event(), threading.Event()
    real = KVFileStore._write_data

    def slow(self, w, buf, offset):
        real(self, w, buf[: len(buf) // 2], offset)  # half the chunk is on disk
        started.set()
        release.wait(10)
        real(self, w, buf, offset)

    monkeypatch.setattr(KVFileStore, "_write_data", slow)
    t = threading.Thread(target=_put, args=(st, 7))
    t.start()
    assert started.wait(10)
    name = chunk_name("model@1@0@7@bfloat16")
    assert not st.contains(name) and _get(st, name) is None and st.is_writing(name)
    assert [f for f in _files(tmp_path) if TMP_RE.match(os.path.basename(f))]
    release.set()
    t.join()
    assert st.contains(name) and torch.equal(_get(st, name), _chunk(7))
    assert st.used_bytes() == st.disk_bytes()


def _die_halfway(path: str) -> None:
    st = _store(path)

    def half_then_die(self, w, buf, offset):
        w.write(buf[: len(buf) // 2], offset)
        os._exit(9)

    KVFileStore._write_data = half_then_die
    _put(st, 3)


def test_writer_killed_halfway_never_becomes_a_hit_and_is_cleaned(tmp_path):
    p = mp.get_context("spawn").Process(target=_die_halfway, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    leftovers = _files(tmp_path)
    assert len(leftovers) == 1 and TMP_RE.match(os.path.basename(leftovers[0]))
    st = _store(tmp_path)  # restart: the scan removes the dead writer's temp file
    assert not st.contains(chunk_name("model@1@0@3@bfloat16"))
    assert _files(tmp_path) == [] and st.used_bytes() == 0 == st.disk_bytes()


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "header"])
def test_short_or_corrupt_file_is_a_miss_and_dropped(tmp_path, damage):
    st = _store(tmp_path)
    name = _put(st, 5)
    (path,) = _files(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - 1000)
        elif damage == "flip":
            f.seek(size - 5)
            b = f.read(1)
            f.seek(size - 5)
            f.write(bytes([b[0] ^ 0xFF]))
        elif damage == "empty":
            f.truncate(0)
        else:
            f.seek(20)
            f.write(b"\xff\xfe")
    assert _get(st, name) is None
    assert not os.path.exists(path) and not st.contains(name)
    assert st.stats.snapshot()["corrupt_dropped"] == 1
    assert st.used_bytes() == st.disk_bytes() == 0


def test_eviction_tolerates_files_removed_or_truncated_by_others(tmp_path):
    one = len(_chunk(0).view(torch.uint8).flatten()) + 4096
    st = _store(tmp_path, max_bytes=3 * one, min_rescan_interval_s=0.0)
    names = [_put(st, i) for i in range(3)]
    os.unlink(st.path_for(names[0]))  # removed by someone else
    with open(st.path_for(names[1]), "r+b") as f:
        f.truncate(1000)  # truncated by someone else
    for i in range(3, 6):
        _put(st, i)
        assert st.used_bytes() == st.disk_bytes() <= 3 * one
    assert [st.contains(n) for n in names] == [False, False, False]
    assert all(torch.equal(_get(st, chunk_name(f"model@1@0@{i:x}@bfloat16")), _chunk(i)) for i in range(3, 6))


def test_capacity_just_below_working_set(tmp_path):
    one = len(_chunk(0).view(torch.uint8).flatten()) + 4096
    st = _store(tmp_path, max_bytes=4 * one - 1)
    for rnd in range(3):
        for i in range(4):
            _put(st, i)
            assert st.used_bytes() == st.disk_bytes() <= 4 * one - 1
    assert len(_files(tmp_path)) == 3 and st.stats.snapshot()["evictions"] >= 8
    with pytest.raises(InsufficientSpaceError):
        _store(tmp_path / "tiny", max_bytes=one - 1).write(
            "0" * 32, "k", "KV_2LTD", [("BF16", SHAPE, one - 4096)], memoryview(bytes(one - 4096)))


def test_pinned_chunks_are_not_evicted(tmp_path):
    one = len(_chunk(0).view(torch.uint8).flatten()) + 4096
    st = _store(tmp_path, max_bytes=2 * one)
    a, b = _put(st, 0), _put(st, 1)
    st.pin(a)
    _put(st, 2)
    assert st.contains(a) and not st.contains(b)
    st.pin(chunk_name("model@1@0@2@bfloat16"))
    with pytest.raises(InsufficientSpaceError):
        _put(st, 3)
    assert st.used_bytes() == st.disk_bytes() == 2 * one


def test_index_rebuilt_on_start_and_reused(tmp_path):
    st = _store(tmp_path)
    names = [_put(st, i) for i in range(4)]
    st.close()
    st2 = _store(tmp_path)
    assert sorted(st2.names()) == sorted(names)
    assert st2.used_bytes() == st2.disk_bytes()
    assert all(torch.equal(_get(st2, n), _chunk(i)) for i, n in enumerate(names))


def test_o_direct_reads_are_exact(tmp_path):
    st = _store(tmp_path, o_direct=True)
    name = _put(st, 9)
    h = st.open_chunk(name)
    import mmap

    raw = mmap.mmap(-1, h.nbytes)  # page-aligned buffer
    mv = memoryview(raw)
    for s, n in h.pieces():
        st.read_piece(h, mv, s, n)
    direct = h.fd_direct >= 0
    st.close_chunk(h)
    got = torch.frombuffer(bytearray(mv), dtype=torch.bfloat16).view(SHAPE)
    mv.release()
    raw.close()
    assert torch.equal(got, _chunk(9))
    print("O_DIRECT used:", direct)


def _mp_writer(path: str, first: int, count: int, max_bytes: int) -> None:
    st = _store(path, max_bytes=max_bytes, min_rescan_interval_s=0.0)
    for i in range(first, first + count):
        _put(st, i)
        _put(st, 1000)  # the same key from every process: one file


def test_processes_share_one_capacity_limit(tmp_path):
    one = len(_chunk(0).view(torch.uint8).flatten()) + 4096
    cap = 5 * one
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_mp_writer, args=(str(tmp_path), 100 * k, 6, cap)) for k in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    st = _store(tmp_path, max_bytes=cap)
    files = _files(tmp_path)
    assert sum(os.path.getsize(f) for f in files) <= cap
    assert not [f for f in files if TMP_RE.match(os.path.basename(f))]
    assert st.used_bytes() == st.disk_bytes()
    for f in files:  # every surviving chunk is complete and correct
        name = os.path.basename(f)[:32]
        assert _get(st, name) is not None


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_tier_fails_the_put_cleanly(tiny_tmpfs):
    st = _store(tiny_tmpfs)
    ok = []
    with pytest.raises(OSError) as ei:
        for i in range(10):  # 1 MiB holds three 260 KiB chunks, not four
            ok.append(_put(st, i))
    assert ei.value.errno == errno.ENOSPC
    assert len(ok) == 3
    assert not st.contains(chunk_name(f"model@1@0@{len(ok):x}@bfloat16"))
    assert not [f for f in _files(tiny_tmpfs) if TMP_RE.match(os.path.basename(f))]
    assert st.used_bytes() == st.disk_bytes()
    assert all(torch.equal(_get(st, n), _chunk(i)) for i, n in enumerate(ok))
    st.close()


@pytest.mark.parametrize("old, new", [(b'"kv.0"', b'"kv.2"'), (b'"kv.0"', b'"kv/0"'),
                                      (b'"__metadata__"', b'"^_metadata__"'), (b'"kv.1"', b'"kv.0"')])
def test_a_damaged_header_is_a_miss_never_another_layout(tmp_path, old, new):
    """The piece checksums cover the data only: a header byte flipped 'kv.0' -> 'kv.2' in a two-group
    chunk was a hit with the groups' shapes swapped over the same bytes, and other flips raised
    IndexError / UnsupportedDtypeError out of open_chunk (into LMCache's retrieve), the file kept
    (an LMCache KV-tier differential probe). Any header that is not what write() writes is a miss,
    and the file is dropped."""
    st = _store(tmp_path)
    a, b = _chunk(1), _chunk(2)[:, :, :128]  # two groups of different shapes
    key = "model@1@0@ab@bfloat16"
    buf = memoryview(torch.cat([a.reshape(-1), b.reshape(-1)]).view(torch.uint8).numpy()).cast("B")
    name = chunk_name(key)
    st.write(name, key, "KV_2LTD", [("BF16", tuple(a.shape), a.numel() * 2), ("BF16", tuple(b.shape), b.numel() * 2)], buf)
    h = st.open_chunk(name)
    assert h is not None and h.groups == [("BF16", tuple(a.shape)), ("BF16", tuple(b.shape))]
    st.close_chunk(h)
    path = st.path_for(name)
    raw = open(path, "rb").read()
    assert raw.count(old) == 1
    open(path, "wb").write(raw.replace(old, new))
    assert st.open_chunk(name) is None  # a miss, no exception
    assert not os.path.exists(path) and not st.contains(name)  # dropped: not a hit again, not an error again


@pytest.mark.parametrize("first_fails", [False, True])
def test_a_second_write_of_a_chunk_being_written_waits_for_the_first(tmp_path, monkeypatch, first_fails):
    """Two threads of one process write one chunk: the second returned False ("exists") at once while
    the first was still writing, so an LMCache store task reported a key stored that was not yet
    committed, or never was when the first write failed (an L2 probe). Now it waits: then the chunk
    exists (False), or the first failed and the second writes it (True)."""
    st = _store(tmp_path)
    started, release = threading.Event(), threading.Event()
    real = KVFileStore._write_data

    def slow(self, w, buf, offset):
        if threading.current_thread().name == "first":
            started.set()
            release.wait(10)
            if first_fails:
                raise OSError(errno.EIO, "injected")
        real(self, w, buf, offset)

    monkeypatch.setattr(KVFileStore, "_write_data", slow)
    got = {}

    def put(tag):
        t = _chunk(7)
        key = "model@1@0@7@bfloat16"
        buf = memoryview(t.view(torch.uint8).numpy()).cast("B")
        try:
            got[tag] = st.write(chunk_name(key), key, "KV_2LTD", [("BF16", SHAPE, len(buf))], buf)
        except OSError as e:
            got[tag] = e

    t1 = threading.Thread(target=put, args=("first",), name="first")
    t1.start()
    assert started.wait(10)
    t2 = threading.Thread(target=put, args=("second",), name="second")
    t2.start()
    t2.join(0.5)
    assert t2.is_alive(), "the second write returned while the first was still writing"
    release.set()
    t1.join(10)
    t2.join(10)
    name = chunk_name("model@1@0@7@bfloat16")
    if first_fails:
        assert isinstance(got["first"], OSError) and got["second"] is True
    else:
        assert got["first"] is True and got["second"] is False
    assert st.contains(name) and torch.equal(_get(st, name), _chunk(7))
    assert st.used_bytes() == st.disk_bytes()


def test_a_read_error_is_a_miss_that_keeps_the_file_and_leaks_nothing(tmp_path, monkeypatch):
    """EIO opening or reading a good chunk (ESTALE on a network tier...) raised out of a get, leaked the
    descriptors of the chunks already opened, and any read error deleted the file for every process
    (an in-process backend probe). Now: a miss, the file kept, nothing left open; a bad file is still dropped."""
    st = _store(tmp_path)
    name = _put(st, 3)
    path = st.path_for(name)
    real_open = st._be.open_read

    def eio_open(p, *a, **k):
        if p == path:
            raise OSError(errno.EIO, "injected EIO", p)
        return real_open(p, *a, **k)

    monkeypatch.setattr(st._be, "open_read", eio_open)
    fds = len(os.listdir("/proc/self/fd"))
    assert st.open_chunk(name) is None
    assert len(os.listdir("/proc/self/fd")) == fds and os.path.exists(path)
    monkeypatch.setattr(st._be, "open_read", real_open)
    h = st.open_chunk(name)
    st.read_failed(h, OSError(errno.EIO, "injected EIO while reading"))  # what a get does on a failed piece
    st.close_chunk(h)
    assert os.path.exists(path) and torch.equal(_get(st, name), _chunk(3))
    h = st.open_chunk(name)
    st.read_failed(h, CorruptCheckpointError("checksum mismatch", path=path))
    st.close_chunk(h)
    assert not os.path.exists(path) and not st.contains(name)


def test_remove_drops_this_process_pins_of_the_chunk(tmp_path):
    """pin, remove, put again: the new chunk stayed pinned (never evicted by this process), where
    LMCache's local disk backend drops the pin with the entry (an in-process backend probe)."""
    st = _store(tmp_path)
    name = _put(st, 4)
    st.pin(name)
    assert st.remove(name)
    assert _put(st, 4) == name and st.contains(name)
    assert st.unpin(name) is False, "the removed chunk's pin survived into the new one"
