"""Handed case C6: interrupted or failed saves.

Step 100 is committed; step 200 then fails (SIGKILL after k of n shard files, ENOSPC on a
small tmpfs and from a faulty backend, EIO from pwrite or fsync). Afterwards: the error reached
the caller with its type, ``latest`` still resolves to 100 and loads bit-exactly, nothing
partial looks committed, leftovers are cleaned or listed as skipped by ``fastckpt ls``, and
retention never removed step 100.
"""

from __future__ import annotations

import errno
import inspect
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.cli.main import main as cli_main
from fastckpt.errors import CheckpointNotFoundError, InsufficientSpaceError
from fastckpt.storage.io import PosixBackend

from fastckpt_testkit import FaultyBackend, assert_tree_same, listing, no_temps


def state_for(step: int, n_layers: int = 4, numel: int = 20_000):
    g = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n_layers)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(100, generator=g)}}, "param_groups": [{"lr": 0.1}]},
            "step": step}


def check_intact(root, ref100, *, temps_allowed=False):
    """Step 100 is the only committed step, resolves as latest, loads bit-exactly."""
    mgr = CheckpointManager(root)
    assert mgr.steps() == [100]
    assert mgr.latest() == 100
    assert (root / "latest").read_text().strip() == "100"
    assert not (root / "step-200").exists()
    assert not fastckpt.is_committed(root / "step-200")
    assert_tree_same(ref100, mgr.load())
    assert fastckpt.verify(mgr.path(100)).ok
    if not temps_allowed:
        assert no_temps(root), listing(root)
    return mgr


@pytest.fixture
def root100(tmp_path):
    root = tmp_path / "run"
    ref = state_for(100)
    CheckpointManager(root, keep_last=1).save(100, ref)
    return root, ref


# ---------------------------------------------------------------- (a) SIGKILL after k of n shard files

CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from fastckpt import CheckpointManager
    from fastckpt.storage.io import PosixBackend

    mode, k = sys.argv[2], int(sys.argv[3])

    class KillAfter(PosixBackend):
        fsyncs = 0
        writes = 0
        def fsync(self, fd):
            if mode == "fsync" and KillAfter.fsyncs == k:   # k files are durable, the next is not
                os.kill(os.getpid(), signal.SIGKILL)
            super().fsync(fd)
            KillAfter.fsyncs += 1
        def pwrite(self, fd, data, offset):
            KillAfter.writes += 1
            if mode == "pwrite" and KillAfter.writes == k:
                n = super().pwrite(fd, data[: len(data) // 2], offset)   # half a write unit lands
                os.kill(os.getpid(), signal.SIGKILL)
            return super().pwrite(fd, data, offset)

    mgr = CheckpointManager(sys.argv[1], keep_last=1)
    # 4 model shards of 80 KB + 1 state shard; write units of 16 KiB
    mgr.save(200, state_for(200), max_shard_bytes=80_000, chunk_bytes=16384, threads=2, io_backend=KillAfter())
    print("NOT KILLED")
""")


@pytest.mark.parametrize("mode, k", [("fsync", 2), ("pwrite", 7)])
def test_c6a_sigkill_after_k_of_n_shards(root100, tmp_path, capsys, mode, k):
    root, ref = root100
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(inspect.getsource(state_for)) + CHILD)
    p = subprocess.run([sys.executable, str(script), str(root), mode, str(k)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    temps = [n for n in listing(root) if n.startswith(".step-200")]
    assert len(temps) == 1  # the killed writer's hidden folder, with some shard files in it
    shards = [n for n in os.listdir(root / temps[0]) if n.endswith(".safetensors")]
    assert shards and "manifest.json" not in os.listdir(root / temps[0])
    check_intact(root, ref, temps_allowed=True)
    # `fastckpt ls` says what it skipped and why
    capsys.readouterr()
    assert cli_main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {temps[0]}" in out and "dead writer" in out
    assert "latest committed: 100" in out
    # the next save removes the dead writer's leftovers; retention then keeps only the newest
    mgr = CheckpointManager(root, keep_last=1)
    ref300 = state_for(300)
    mgr.save(300, ref300)
    assert mgr.steps() == [300] and no_temps(root) and mgr.skipped() == []
    assert_tree_same(ref300, mgr.load())


# ---------------------------------------------------------------- (b) out of space

@pytest.fixture
def tmpfs8m(tmp_path):
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_c6b_tmpfs_too_small_refused_before_staging(tmpfs8m):
    root = tmpfs8m / "run"
    ref = state_for(100)  # 320 KB
    mgr = CheckpointManager(root)
    mgr.save(100, ref)
    big = state_for(200, n_layers=3, numel=1_000_000)  # 12 MB > 8 MB
    with pytest.raises(InsufficientSpaceError) as ei:
        mgr.save(200, big)
    assert isinstance(ei.value, OSError) and "bytes free" in str(ei.value)
    check_intact(root, ref)


class FillAfterCheck(PosixBackend):
    """Another writer eats the free space right after the free-space check (and no fallocate),
    so the kernel itself returns ENOSPC in the middle of a shard."""

    def __init__(self, filler):
        self.filler = filler
        self.filled = False

    def allocate(self, fd, nbytes):
        pass

    def open_write(self, path, o_direct=False):
        if not self.filled:
            self.filled = True
            st = os.statvfs(os.path.dirname(self.filler))
            free = st.f_bavail * st.f_frsize
            with open(self.filler, "wb") as f:
                f.write(b"\0" * max(0, free - (300 << 10)))  # leave 300 KiB: the first shard half fits
        return super().open_write(path, o_direct)


def test_c6b_tmpfs_enospc_mid_shard(tmpfs8m):
    root = tmpfs8m / "run"
    ref = state_for(100)
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(100, ref)
    filler = str(tmpfs8m / "filler")
    fut = mgr.async_save(200, state_for(200, n_layers=2, numel=300_000), io_backend=FillAfterCheck(filler),
                         chunk_bytes=64 << 10)
    with pytest.raises(OSError) as ei:
        fut.result()
    assert ei.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as again:
        fut.result()
    assert again.value is ei.value
    os.unlink(filler)
    check_intact(root, ref)


def test_c6b_faulty_backend_enospc_mid_shard(root100):
    root, ref = root100
    be = FaultyBackend(fail_pwrite_after=200_000, err=errno.ENOSPC)
    mgr = CheckpointManager(root, keep_last=1)
    with pytest.raises(OSError) as ei:
        mgr.save(200, state_for(200), max_shard_bytes=80_000, chunk_bytes=16384, io_backend=be)
    # typed and naming the file (a bare OSError named none: a README-only trial), caused by the injected one
    from fastckpt.errors import InsufficientSpaceError
    assert isinstance(ei.value, InsufficientSpaceError) and ei.value.errno == errno.ENOSPC
    assert ei.value.__cause__ is be.raised[0] and ei.value.filename.endswith(".safetensors"), ei.value
    check_intact(root, ref)


# ---------------------------------------------------------------- (c) EIO

@pytest.mark.parametrize("fault", [dict(fail_pwrite_after=50_000), dict(fail_pwrite_after=0), dict(fail_fsync=True)])
def test_c6c_eio(root100, fault):
    root, ref = root100
    be = FaultyBackend(err=errno.EIO, **fault)
    mgr = CheckpointManager(root, keep_last=1)
    fut = mgr.async_save(200, state_for(200), max_shard_bytes=80_000, chunk_bytes=16384, io_backend=be)
    with pytest.raises(OSError) as ei:
        fut.result()
    assert ei.value in be.raised and ei.value.errno == errno.EIO
    check_intact(root, ref)
    # the failure was collected: the next save goes through and becomes latest
    mgr.save(200, state_for(200))
    assert mgr.steps() == [200] and (root / "latest").read_text().strip() == "200"


def test_c6c_uncollected_eio_raised_by_next_manager_save(root100):
    root, ref = root100
    be = FaultyBackend(fail_pwrite_after=0, err=errno.EIO)
    mgr = CheckpointManager(root, keep_last=1)
    fut = mgr.async_save(200, state_for(200), io_backend=be)
    fut.exception()  # wait without collecting
    with pytest.raises(OSError) as ei:
        mgr.save(300, state_for(300))
    assert ei.value is be.raised[0]
    check_intact(root, ref)


# ---------------------------------------------------------------- a newer-looking folder without a manifest

def test_c6_truncated_newer_folder_without_manifest_is_skipped(root100, capsys):
    root, ref = root100
    fake = CheckpointManager(root / "elsewhere").save(300, state_for(300))
    os.rename(fake, root / "step-300")
    os.unlink(root / "step-300" / "manifest.json")
    shard = root / "step-300" / "model.safetensors"
    os.truncate(shard, os.path.getsize(shard) // 2)
    mgr = CheckpointManager(root)
    assert mgr.latest() == 100 and mgr.steps() == [100]
    assert [n for n, _ in mgr.skipped()] == ["step-300"]
    assert_tree_same(ref, mgr.load())
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(300)
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        fastckpt.load(root / "step-300")
    capsys.readouterr()
    assert cli_main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "skipped step-300" in out and "manifest" in out and "latest committed: 100" in out
    # retention counts committed steps only: the fake folder never pushes step 100 out
    mgr2 = CheckpointManager(root, keep_last=1)
    assert mgr2.prune(1) == [] and mgr2.steps() == [100]


def test_exit_while_a_background_reserve_runs_is_a_clean_exit():
    """A process that exits while Saver.reserve(background=True) faults in its buffer (the Trainer
    callback reserves at train begin; a train() failing before the first save) died with SIGABRT
    ('terminate called without an active exception', rc 134): the daemon thread was still inside its
    torch op when libtorch's static destructors ran (a Trainer differential probe). It exits with the
    process's own status."""
    code = "import sys, fastckpt\nfastckpt.Saver().reserve(1 << 30)\nsys.exit(3)\n"
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 3 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-500:])
