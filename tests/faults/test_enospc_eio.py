"""I/O failures during a save (issue 7, cases C6b/C6c): ENOSPC on a small tmpfs, EIO, failed fsync,
a read-only tier and a tier folder removed mid-save. Each must raise a typed error on the caller,
commit nothing, keep the previous checkpoint bit-exact and leak no thread, fd, lock or staging memory.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest

import fastckpt
from fastckpt.storage.lock import RootLock

from faultkit import (SAVE_OPTS, FaultyBackend, leaks, make_state, remount, same_state, snapshot, temp_leftovers,
                      tmpfs)


@pytest.fixture
def small_tier():
    try:
        with tmpfs("8m") as d:
            yield d
    except PermissionError as e:
        pytest.skip(str(e))


def _start(mgr, step, backend):
    """Run a save; return the exception whether raised by async_save or by result()."""
    try:
        fut = mgr.async_save(step, make_state(step), io_backend=backend, **SAVE_OPTS)
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        return e, "async_save"
    try:
        fut.result()
    except Exception as e:  # noqa: BLE001
        return e, "result"
    return None, None


def _assert_intact(root: str, mgr, prev_step: int, before) -> None:
    assert mgr.steps() == [prev_step], f"something was committed: {mgr.steps()}"
    assert not fastckpt.is_committed(mgr.path(prev_step + 100))
    assert temp_leftovers(root) == [], "a failed save must remove its temporary folder"
    assert same_state(make_state(prev_step), mgr.load(verify=True)) is None
    assert fastckpt.verify(mgr.path(prev_step)).ok
    assert leaks(before) == []
    assert not mgr._saver.pool._busy.locked(), "staging buffer still held"
    assert not mgr._lock.held, "root lock still held"
    with RootLock(root):  # another job can take the root again
        pass


@pytest.mark.parametrize("kind", ["pwrite", "fallocate"])
def test_enospc_mid_shard(small_tier, kind):
    """Another writer fills the tier after the free-space check: ENOSPC in pwrite (mid-shard) or fallocate."""
    root = os.path.join(small_tier, "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    free = os.statvfs(small_tier).f_bavail * os.statvfs(small_tier).f_frsize

    def fill():
        with open(os.path.join(small_tier, "ballast"), "wb") as f:
            f.write(b"\0" * (free - (600 << 10)))  # leave less than the state needs

    be = FaultyBackend("open_write", nth=2, err=None, hook=fill, no_allocate=(kind == "pwrite"))
    before = snapshot()
    exc, where = _start(mgr, 200, be)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, (exc, where)
    if kind == "pwrite":
        assert where == "result", "a background ENOSPC must reach the caller through result()"
    _assert_intact(root, mgr, 100, before)
    os.unlink(os.path.join(small_tier, "ballast"))
    mgr.save(200, make_state(200), **SAVE_OPTS)  # the tier recovered: the next save works
    assert mgr.steps() == [100, 200]


def test_insufficient_space_refused_before_any_file(small_tier):
    root = os.path.join(small_tier, "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    before = snapshot()
    with pytest.raises(fastckpt.InsufficientSpaceError):
        mgr.save(200, make_state(200, scale=8), **SAVE_OPTS)
    _assert_intact(root, mgr, 100, before)
    deep = os.path.join(small_tier, "other", "run", "step-1")  # parents that do not exist yet
    with pytest.raises(fastckpt.InsufficientSpaceError, match="other/run"):
        fastckpt.save(make_state(300, scale=8), deep)
    assert not os.path.exists(os.path.join(small_tier, "other")), "a refused save must create no folder"


@pytest.mark.parametrize("method,nth,err", [
    ("pwrite", 1, errno.EIO), ("pwrite", 4, errno.EIO), ("fsync", 1, errno.EIO), ("fsync", 3, errno.EIO),
    ("pwrite", 2, errno.ENOSPC), ("close", 1, errno.EIO), ("open_write", 2, errno.EIO)])
def test_eio_and_failed_fsync(tmp_path, method, nth, err):
    root = str(tmp_path / "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    be = FaultyBackend(method, nth=nth, err=err)
    before = snapshot()
    exc, where = _start(mgr, 200, be)
    assert be.fired, "the fault was never injected"
    if err == errno.ENOSPC:  # the device full mid-write: typed, naming the file, the injected error as cause
        assert type(exc) is fastckpt.errors.InsufficientSpaceError and exc.errno == err, (exc, where)
        assert exc.filename and ".fastckpt-tmp-" in exc.filename and exc.__cause__ is not None, (exc, where)
    else:
        assert type(exc) is OSError and exc.errno == err, (exc, where)
    _assert_intact(root, mgr, 100, before)


def test_repeated_failures_leak_nothing(tmp_path):
    """Ten failing saves in a row: no growth of threads, fds or resident memory beyond one staging buffer."""
    root = str(tmp_path / "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    exc, _ = _start(mgr, 200, FaultyBackend("fsync", nth=1))
    before = snapshot()
    for _ in range(10):
        exc, _ = _start(mgr, 200, FaultyBackend("pwrite", nth=3))
        assert isinstance(exc, OSError) and exc.errno == errno.EIO
    assert leaks(before) == []
    assert snapshot().rss_bytes - before.rss_bytes < 32 << 20
    _assert_intact(root, mgr, 100, before)


def test_read_only_tier(small_tier):
    root = os.path.join(small_tier, "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    remount(small_tier, "ro")
    try:
        before = snapshot()
        with pytest.raises(OSError) as ei:
            mgr.save(200, make_state(200), **SAVE_OPTS)
        assert ei.value.errno == errno.EROFS
        with pytest.raises(OSError) as ei:
            fastckpt.save(make_state(200), os.path.join(root, "plain"), **SAVE_OPTS)
        assert ei.value.errno == errno.EROFS
        assert mgr.steps() == [100] and leaks(before) == []
        assert same_state(make_state(100), mgr.load(verify=True)) is None  # reading a ro tier works
    finally:
        remount(small_tier, "rw")


@pytest.mark.parametrize("what", ["temp folder", "whole root"])
def test_tier_folder_removed_during_async_save(tmp_path, what):
    root = str(tmp_path / "run")
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)

    def remove():
        if what == "whole root":
            shutil.rmtree(root)
        else:
            for n in temp_leftovers(root):
                shutil.rmtree(os.path.join(root, n))

    be = FaultyBackend("pwrite", nth=2, err=None, hook=remove)
    before = snapshot()
    fut = mgr.async_save(200, make_state(200), io_backend=be, **SAVE_OPTS)
    with pytest.raises(FileNotFoundError):
        fut.result()
    assert be.fired
    assert leaks(before) == [] and not mgr._lock.held and not mgr._saver.pool._busy.locked()
    if what == "whole root":
        assert mgr.steps() == [] and not os.path.exists(mgr.path(200))
        mgr.save(300, make_state(300), **SAVE_OPTS)  # the manager recreates the root
        assert mgr.steps() == [300]
    else:
        _assert_intact(root, mgr, 100, before)


def test_enospc_in_small_file_is_typed(small_tier):
    """A device that fills while state.json / manifest.json is written gives InsufficientSpaceError
    naming the file (it was a bare ``OSError: [Errno 28]`` naming nothing)."""
    from fastckpt.storage.commit import write_small_file

    filler = os.path.join(small_tier, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the 8 MiB tmpfs to the last byte
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    target = os.path.join(small_tier, "manifest.json")
    with pytest.raises(fastckpt.InsufficientSpaceError, match="manifest.json") as ei:
        write_small_file(target, b"x" * (1 << 20))
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value.__cause__, OSError)
    assert ei.value.filename == target
