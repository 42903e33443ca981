"""CheckpointManager: steps, latest pointer, retention, refusal of existing steps, stale temporaries."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.storage.commit import OWNER, TMP_MARK
from fastckpt.errors import CheckpointExistsError, CheckpointNotFoundError
from fastckpt.storage.io import PosixBackend

from fastckpt_testkit import FaultyBackend, assert_tree_same, listing, no_temps


def st(step):
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, generator=g)}, "step": step}


def test_steps_latest_path_load(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.steps() == [] and mgr.latest() is None
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        mgr.load()
    for s in (10, 2, 30):
        assert mgr.save(s, st(s)) == tmp_path / "run" / f"step-{s}"
    assert mgr.steps() == [2, 10, 30] and mgr.latest() == 30
    assert (tmp_path / "run" / "latest").read_text().strip() == "30"
    assert mgr.path(7) == tmp_path / "run" / "step-7"
    assert_tree_same(st(30), mgr.load())
    assert_tree_same(st(2), mgr.load(2))
    assert_tree_same({"model": st(10)["model"]}, mgr.load(10, keys="model"))
    with pytest.raises(CheckpointNotFoundError, match="step 5 is not committed"):
        mgr.load(5)
    m = json.loads((mgr.path(10) / "manifest.json").read_text())
    assert m["step"] == 10


def test_existing_step_refused_unless_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, st(1))
    with pytest.raises(CheckpointExistsError, match="step 1 exists"):
        mgr.save(1, st(2))
    with pytest.raises(CheckpointExistsError):
        mgr.async_save(1, st(2))
    assert_tree_same(st(1), mgr.load(1))
    mgr.save(1, st(2), overwrite=True)
    assert_tree_same(st(2), mgr.load(1))
    assert mgr.steps() == [1] and no_temps(tmp_path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, prefix=".hidden-")
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, prefix="a/b")
    mgr = CheckpointManager(tmp_path)
    for bad in (-1, "3", 1.0, True):
        with pytest.raises(ValueError):
            mgr.save(bad, st(0))
    with pytest.raises(ValueError):
        mgr.prune(0)
    assert listing(tmp_path) == []


def test_keep_last_counts_committed_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for s in range(1, 6):
        mgr.save(s, st(s))
        assert mgr.steps() == list(range(max(1, s - 1), s + 1))
    assert [n for n in listing(tmp_path) if not n.startswith(".")] == ["latest", "step-4", "step-5"]
    assert no_temps(tmp_path)
    assert_tree_same(st(4), mgr.load(4))


class WatchPrevious(PosixBackend):
    """Records, at every fsync of the new step's files (before its commit), which steps are committed."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.seen = []

    def fsync(self, fd):
        self.seen.append(self.mgr.steps())
        super().fsync(fd)


def test_keep_last_never_removes_newest_before_newer_commit(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, st(1))
    spy = WatchPrevious(CheckpointManager(tmp_path))
    mgr.save(2, st(2), io_backend=spy)
    assert spy.seen and all(s == [1] for s in spy.seen)  # step 1 lived until step 2 committed
    assert mgr.steps() == [2]
    # a failed save never triggers retention
    be = FaultyBackend(fail_pwrite_after=0, err=errno.EIO)
    with pytest.raises(OSError):
        mgr.save(3, st(3), io_backend=be)
    assert mgr.steps() == [2] and (tmp_path / "latest").read_text().strip() == "2"
    assert_tree_same(st(2), mgr.load())


def test_scan_wins_over_stale_latest_file(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, st(1))
    mgr.save(2, st(2))
    (tmp_path / "latest").write_text("1\n")  # crash between the commit of 2 and the pointer update
    assert mgr.latest() == 2
    assert_tree_same(st(2), mgr.load())
    (tmp_path / "latest").write_text("garbage")
    assert mgr.latest() == 2
    mgr.save(3, st(3))
    assert (tmp_path / "latest").read_text().strip() == "3"


def test_prefix_and_unrelated_folders(tmp_path):
    mgr = CheckpointManager(tmp_path, prefix="checkpoint-")
    mgr.save(5, st(5))
    (tmp_path / "checkpoint-abc").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "checkpoint-9").write_text("a file, not a folder")
    assert mgr.steps() == [5] and mgr.path(5).name == "checkpoint-5"
    assert CheckpointManager(tmp_path).steps() == []  # other prefix


def test_async_save_and_wait(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    w = torch.randn(1000)
    ref = w.clone()
    fut = mgr.async_save(1, {"w": w})
    w.zero_()
    mgr.wait()
    assert fut.done() and fut.result() == mgr.path(1)
    assert torch.equal(mgr.load()["w"], ref)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_removed_live_ones_kept(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    mgr.save(1, st(1))
    dead = tmp_path / f".step-2{TMP_MARK}1-dead"
    live = tmp_path / f".step-3{TMP_MARK}2-live"
    for d, pid in ((dead, _dead_pid()), (live, os.getpid())):
        d.mkdir()
        (d / OWNER).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started_unix_s": time.time()}))
        (d / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    reasons = dict(mgr.skipped())
    assert "dead writer" in reasons[dead.name] and "live writer" in reasons[live.name]
    assert mgr.steps() == [1]
    assert mgr.prune(5) == []
    assert not dead.exists() and live.exists()
    assert mgr.steps() == [1]


def test_prune_keeps_newest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for s in (1, 2, 3, 4):
        mgr.save(s, st(s))
    assert mgr.prune(2, protect=(1,)) == [2]
    assert mgr.steps() == [1, 3, 4]
    assert mgr.prune(1) == [1, 3]
    assert mgr.steps() == [4] and no_temps(tmp_path)
    assert_tree_same(st(4), mgr.load())


def test_keep_last_never_prunes_the_step_just_saved(tmp_path, caplog):
    """An earlier run left step-500 in the root; this run saves step 100 with keep_last=1: the
    returned folder exists and is the one kept (step-500 is the older commit, deleted as the
    Trainer's rotation deletes an earlier run's checkpoint), and load() returns this run's state.
    (Until issue 20 the highest step was kept and loaded: this run's state was the one lost.)"""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(500, st(500))
    mgr2 = CheckpointManager(tmp_path, keep_last=1)  # the new run
    p = mgr2.save(100, st(100))
    assert p == tmp_path / "step-100" and p.is_dir()
    assert mgr2.steps() == [100] and mgr2.latest() == 100
    assert_tree_same(st(100), mgr2.load())
    p = mgr2.save(200, st(200))
    assert p.is_dir() and mgr2.steps() == [200]


def _mirror_rotation(mirror, order: list[int], limit: int) -> list[int]:
    """transformers' own rotation (``rotate_checkpoints(use_mtime=True)``, as ``Trainer._save_checkpoint``
    calls it) over ``checkpoint-N`` folders created in the commit ``order`` (mtimes 10 s apart)."""
    from transformers.trainer_utils import rotate_checkpoints

    t0 = time.time() - 10 * len(order)
    for i, s in enumerate(order):
        d = mirror / f"checkpoint-{s}"
        d.mkdir(exist_ok=True)
        os.utime(d, (t0 + 10 * i, t0 + 10 * i))
    rotate_checkpoints(str(mirror), save_total_limit=limit, use_mtime=True)
    return sorted(int(p.name.split("-")[1]) for p in mirror.iterdir())


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_new_run_in_an_old_root_keeps_its_own_checkpoints_as_the_trainer_does(tmp_path, capsys, keep):
    """Issue 20: an earlier run committed steps 400 and 500; a new run in the same root saves 100, 200,
    300 with keep_last. Retention orders by commit time (the manifests'), as transformers rotates (run
    on a mirror of the same commit sequence): the same steps are kept after every save; latest(),
    load(), the ``latest`` file, ``fastckpt ls`` and a fresh manager name this run's newest."""
    pytest.importorskip("transformers")
    from fastckpt.cli.main import main

    root, mirror = tmp_path / "run", tmp_path / "mirror"
    mirror.mkdir()
    old = CheckpointManager(root, keep_last=keep)
    commits: list[int] = []
    for s in (400, 500):
        old.save(s, st(s))
        commits.append(s)
        assert old.steps() == _mirror_rotation(mirror, commits, keep)
    new = CheckpointManager(root, keep_last=keep)
    for s in (100, 200, 300):
        new.save(s, st(s))
        commits.append(s)
        assert new.steps() == _mirror_rotation(mirror, commits, keep), s
        assert new.path(s).is_dir() and new.latest() == s
        assert (root / "latest").read_text() == f"{s}\n"
        assert_tree_same(st(s), new.load())
        assert_tree_same(st(s), CheckpointManager(root).load())  # a resume in a fresh process
        assert main(["ls", str(root)]) == 0
        assert f"latest committed: {s}\n" in capsys.readouterr().out


def test_prune_keeps_the_most_recent_commits_as_ls_shows_them(tmp_path, capsys):
    """``fastckpt prune --keep N`` keeps the N most recently committed steps (the manager's order), not
    the N highest: an earlier run's step-900 (committed first) goes first."""
    from fastckpt.cli.main import main

    mgr = CheckpointManager(tmp_path)
    for s in (900, 1, 2, 3):
        mgr.save(s, st(s))
    assert mgr.latest() == 3
    assert main(["prune", str(tmp_path), "--keep", "2"]) == 0
    assert mgr.steps() == [2, 3]
    assert main(["ls", str(tmp_path)]) == 0
    assert "latest committed: 3\n" in capsys.readouterr().out
    assert_tree_same(st(3), mgr.load())


def test_manifests_without_a_commit_time_order_by_step(tmp_path):
    """Manifests written without ``created_unix_s`` (none of ours, but the field is optional to
    readers): latest() and retention fall back to step order."""
    mgr = CheckpointManager(tmp_path)
    for s in (5, 1, 3):
        mgr.save(s, st(s))
    assert mgr.latest() == 3
    for s in (5, 1, 3):
        f = mgr.path(s) / "manifest.json"
        m = json.loads(f.read_text())
        del m["created_unix_s"]
        f.unlink()
        f.write_text(json.dumps(m))
    assert mgr.latest() == 5
    assert mgr.prune(2) == [1] and mgr.steps() == [3, 5]


def test_a_newer_commit_with_a_damaged_manifest_is_warned_about_and_fails_verify(tmp_path, caplog):
    """step-2's manifest.json truncated after its commit: load() returned step 1 with no word, `ls`
    called step-2 'never committed (crashed save)' and `verify ROOT` checked step 1 and exited 0 (a
    README-only trial). The load still falls back to the newest readable commit, now with a WARNING
    naming step-2; ls says it was damaged after the commit; verify exits 1 naming it."""
    import subprocess
    import sys
    root = tmp_path / "run"
    m = fastckpt.CheckpointManager(root)
    m.save(1, {"w": torch.ones(4)})
    m.save(2, {"w": torch.full((4,), 2.0)})
    with open(root / "step-2" / "manifest.json", "r+b") as f:
        f.truncate(10)
    with caplog.at_level("WARNING", logger="fastckpt"):
        got = fastckpt.CheckpointManager(root).load()
    assert torch.equal(got["w"], torch.ones(4))
    assert any("step-2 is skipped" in r.getMessage() and "damaged after the commit" in r.getMessage()
               for r in caplog.records), caplog.text
    r = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(root), "-q"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "DAMAGED step-2" in r.stdout, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "fastckpt", "ls", str(root)], capture_output=True, text=True, timeout=120)
    assert "step-2: manifest.json is there but unreadable: damaged after the commit" in r.stdout + r.stderr, r.stdout


def test_prune_never_follows_a_symlinked_step_folder(tmp_path):
    """step-10 -> step-3 (an alias): prune --keep 2 deleted the real step-3 and left step-10 dangling; a
    step-1 -> other run's step-2 link got an owner record written into the other run's checkpoint (a
    README-only trial). Symlinked step folders are aliases: not counted, never deleted, never written."""
    import time as _time
    root, other = tmp_path / "run", tmp_path / "other"
    m = CheckpointManager(root)
    m.save(3, {"w": torch.ones(2)})
    _time.sleep(0.05)
    m.save(4, {"w": torch.zeros(2)})
    os.symlink("step-3", root / "step-10")
    fastckpt.CheckpointManager(other).save(2, {"w": torch.ones(2)})
    os.symlink(other / "step-2", root / "step-1")
    before = sorted(os.listdir(other / "step-2"))
    assert CheckpointManager(root).prune(keep=1) == []  # step-4 kept, step-3 is step-10's target; aliases no steps
    assert sorted(os.listdir(other / "step-2")) == before and fastckpt.is_committed(other / "step-2")
    assert os.path.islink(root / "step-10") and os.path.islink(root / "step-1")
    assert CheckpointManager(root).steps() == [3, 4]
    assert any(n == "step-10" and "a symlink to step-3" in why for n, why in CheckpointManager(root).skipped())


def test_ls_of_a_root_with_nothing_committed_exits_2(tmp_path, capsys):
    """A run root holding only a crashed save: `ls` listed nothing and exited 0 while `verify` exits 2
    (a README-only trial); it now lists what it skipped and exits 2."""
    from fastckpt.cli.main import main

    mgr = CheckpointManager(tmp_path)
    mgr.save(1, st(1))
    assert main(["ls", str(tmp_path)]) == 0
    (mgr.path(1) / "manifest.json").rename(tmp_path / "aside.json")  # as a save killed before its commit
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 2
    cap = capsys.readouterr()
    assert "skipped step-1" in cap.out and "no committed checkpoint" in cap.err, cap
