"""Retention (fastckpt/storage/retention.py): selection, safe deletion, and a deletion killed midway.

The three ways in (``CheckpointManager.prune``, the Trainer helper ``rotate_checkpoints``, the
accelerate plugin's ``total_limit``) all delete through ``delete_checkpoint``; a SIGKILL after
its rename leaves a folder that ``fastckpt ls`` does not list as a checkpoint and that the next
``CheckpointManager`` save or ``fastckpt prune`` removes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fastckpt
from fastckpt.cli.main import main as cli_main
from fastckpt.storage import commit as cm
from fastckpt.storage import retention
from fastckpt.storage import store as store_mod
from fastckpt.storage.retention import (delete_checkpoint, prune_checkpoints, scan_checkpoints, select_victims,
                                        step_folders)

ROOT = Path(__file__).resolve().parents[2]


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": step}


def make_root(root: Path, prefix: str, steps) -> fastckpt.CheckpointManager:
    mgr = fastckpt.CheckpointManager(root, prefix=prefix)
    for s in steps:
        mgr.save(s, state(s))
    return mgr


def cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(argv)
    return rc, out.getvalue()


# ---------------------------------------------------------------------------------------------
# selection (pure)
# ---------------------------------------------------------------------------------------------
def test_select_victims_keeps_newest_and_protected():
    assert select_victims([1, 2, 3, 4], keep=2) == [1, 2]
    assert select_victims([4, 1, 3, 2, 3], keep=2) == [1, 2]  # any order, duplicates
    assert select_victims([1, 2, 3, 4], keep=2, protect=[1]) == [2]
    assert select_victims([1, 2, 3, 4], keep=1, protect=[2, 99]) == [1, 3]
    assert select_victims([1, 2], keep=5) == [] and select_victims([], keep=1) == []
    assert select_victims([7], keep=1, protect=[]) == []  # the newest is never a victim
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="keep must be >= 1"):
            select_victims([1, 2], keep=bad)


# ---------------------------------------------------------------------------------------------
# scanning and deleting
# ---------------------------------------------------------------------------------------------
def test_scan_sorts_committed_uncommitted_and_leftovers(tmp_path):
    make_root(tmp_path, "step-", (10, 2))
    (tmp_path / "step-7").mkdir()
    (tmp_path / "step-7" / "model.safetensors").write_bytes(b"partial")  # a crashed foreign save
    (tmp_path / "step-x").mkdir()  # not a step
    (tmp_path / "step-9").write_text("a file, not a folder")
    doomed = tmp_path / f".step-1{cm.TMP_MARK}{os.getpid()}@{cm.host_tag()}-ab.del"
    doomed.mkdir()
    scan = scan_checkpoints(tmp_path, "step-")
    assert scan.steps == [2, 10] and [p.name for _, p in scan.committed] == ["step-2", "step-10"]
    assert [(s, p.name) for s, p in scan.uncommitted] == [(7, "step-7")]
    assert scan.leftovers == [doomed.name]
    why = dict(scan.skipped())
    assert why[doomed.name] == "checkpoint being deleted (live writer)"  # this process: alive
    assert "never committed" in why["step-7"]
    assert [s for s, _ in step_folders(tmp_path, "step-")] == [2, 7, 10]
    assert scan_checkpoints(tmp_path / "missing", "step-").committed == []


def test_delete_checkpoint_renames_to_a_name_the_cleaner_knows(tmp_path, monkeypatch):
    mgr = make_root(tmp_path, "step-", (1, 2))
    seen = {}
    real = store_mod.shutil.rmtree

    def spy(path, *a, **kw):  # the state just before the files go
        seen["path"] = os.fspath(path)
        seen["listing"] = sorted(os.listdir(tmp_path))
        seen["alive"] = cm.owner_alive(os.fspath(path))
        seen["owner"] = os.path.exists(os.path.join(path, cm.OWNER))
        return real(path, *a, **kw)

    monkeypatch.setattr(store_mod.shutil, "rmtree", spy)  # the local store removes the tree
    assert delete_checkpoint(mgr.path(1)) is True
    name = os.path.basename(seen["path"])
    assert "step-1" not in seen["listing"] and name in seen["listing"]
    assert retention.is_temp_name(name) and name.endswith(retention.DOOMED_SUFFIX)
    assert seen["alive"] and seen["owner"]  # the deleting process is alive: no cleaner touches it
    assert not os.path.exists(seen["path"]) and mgr.steps() == [2]
    assert delete_checkpoint(mgr.path(1)) is False


def test_prune_checkpoints_leaves_uncommitted_and_newest(tmp_path):
    make_root(tmp_path, "checkpoint_", (1, 2, 3))
    (tmp_path / "checkpoint_0").mkdir()  # uncommitted: never deleted by retention
    assert prune_checkpoints(tmp_path, "checkpoint_", 1) == [1, 2]
    assert [p.name for _, p in step_folders(tmp_path, "checkpoint_")] == ["checkpoint_0", "checkpoint_3"]
    assert not [n for n in os.listdir(tmp_path) if retention.is_temp_name(n)]


@pytest.mark.parametrize("limit,best,kept", [(2, 4, [4, 16]), (2, 12, [12, 16]), (1, 4, [4, 16]),
                                             (1, 16, [16]), (3, None, [8, 12, 16])])
def test_rotate_checkpoints_counts_the_best_within_the_limit(tmp_path, limit, best, kept):
    """The Trainer's rule: ``save_total_limit`` folders remain, the best among them (two with a
    limit of 1 and an older best)."""
    from fastckpt.integrations.hf.checkpoints import rotate_checkpoints

    mgr = make_root(tmp_path, "checkpoint-", (4, 8, 12, 16))
    gone = rotate_checkpoints(tmp_path, limit, str(mgr.path(best)) if best else None)
    assert mgr.steps() == kept
    assert [p.name for p in gone] == [f"checkpoint-{s}" for s in (4, 8, 12, 16) if s not in kept]


def _set_mtimes(mgr, offsets: dict[int, float]) -> None:
    import time

    now = time.time()
    for s, off in offsets.items():
        os.utime(mgr.path(s), (now + off, now + off))


def test_commit_order_is_the_trainers_mtime_order_with_its_one_second_fallback(tmp_path):
    mgr = make_root(tmp_path, "checkpoint-", (100, 200, 500))
    committed = scan_checkpoints(tmp_path, "checkpoint-").committed
    _set_mtimes(mgr, {500: -3600, 100: -10, 200: 0})  # 500: an earlier run's
    assert retention.commit_order(committed) == [500, 100, 200]
    assert retention.commit_order(committed, use_mtime=False) == [100, 200, 500]
    _set_mtimes(mgr, {500: -0.5, 100: -0.2, 200: 0})  # within 1 s: by step, as sort_checkpoints
    assert retention.commit_order(committed) == [100, 200, 500]


def test_select_victims_in_order_is_the_trainers_rule():
    sel = retention.select_victims_in_order
    assert sel([1, 2, 3, 4], keep=2) == [1, 2]
    assert sel([1, 2, 3, 4], keep=2, protect=[1]) == [2, 3]  # the best counts among the limit
    assert sel([1, 2, 3, 4], keep=1, protect=[1]) == [2, 3]  # limit 1 and an older best: two kept
    assert sel([500, 100, 200], keep=1, protect=[200]) == [500, 100]
    assert sel([100, 500], keep=1, protect=[100]) == []  # never the one just saved (the Trainer: [100])
    assert sel([4, 8], keep=5) == []
    with pytest.raises(ValueError, match="keep"):
        sel([1], keep=0)


@pytest.mark.parametrize("offset,kept", [(-3600, [4]), (+3600, [4, 500])])
def test_rotate_checkpoints_never_deletes_the_checkpoint_just_saved(tmp_path, caplog, offset, kept):
    """checkpoint-500 of an earlier run: committed an hour before (rotated by commit time, named in
    a WARNING) or sorting as the most recent (kept, and so is the checkpoint just saved)."""
    from fastckpt.integrations.hf.checkpoints import rotate_checkpoints

    mgr = make_root(tmp_path, "checkpoint-", (500, 4))
    _set_mtimes(mgr, {500: offset})
    caplog.clear()  # the manager's own warning about step 500 while saving step 4
    with caplog.at_level("WARNING"):
        gone = rotate_checkpoints(tmp_path, 1, None, just_saved=str(mgr.path(4)))
    assert mgr.steps() == kept and mgr.path(4).is_dir()
    assert [p.name for p in gone] == ([] if 500 in kept else ["checkpoint-500"])
    assert ("earlier run" in caplog.text) is (500 not in kept)


# ---------------------------------------------------------------------------------------------
# SIGKILL in the middle of a deletion
# ---------------------------------------------------------------------------------------------
_KILLER = textwrap.dedent("""
    import os, shutil, signal, sys

    real = shutil.rmtree

    def die_midway(path, *a, **kw):
        path = os.fspath(path)
        if path.endswith(".del"):  # the renamed checkpoint: delete part of it, then get killed
            for name in sorted(os.listdir(path))[:2]:
                os.unlink(os.path.join(path, name))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *a, **kw)

    shutil.rmtree = die_midway
    who, root = sys.argv[1], sys.argv[2]
    if who == "manager":
        import fastckpt
        fastckpt.CheckpointManager(root, prefix="step-").prune(1)
    elif who == "trainer":
        from fastckpt.integrations.hf.checkpoints import rotate_checkpoints
        rotate_checkpoints(root, 1)
    else:
        from types import SimpleNamespace
        from fastckpt.integrations.accelerate.plugin import FastCkptState
        cfg = SimpleNamespace(automatic_checkpoint_naming=True, total_limit=1)
        FastCkptState(SimpleNamespace(project_configuration=cfg, project_dir=os.path.dirname(root)))._rotate()
    print("not killed")
""")

_PREFIX = {"manager": "step-", "trainer": "checkpoint-", "accelerate": "checkpoint_"}


@pytest.mark.parametrize("cleaner", ["next save", "fastckpt prune"])
@pytest.mark.parametrize("who", ["manager", "trainer", "accelerate"])
def test_sigkill_during_deletion_leaves_no_checkpoint_and_is_cleaned(tmp_path, who, cleaner):
    prefix = _PREFIX[who]
    root = tmp_path / "checkpoints"
    mgr = make_root(root, prefix, (1, 2))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _KILLER, who, str(root)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr[-2000:])

    # killed after the rename, with part of the files gone: a hidden leftover, never a checkpoint
    leftovers = [n for n in os.listdir(root) if retention.is_temp_name(n)]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{prefix}1") and leftovers[0].endswith(".del")
    assert not (root / f"{prefix}1").exists() and mgr.steps() == [2]
    assert len(os.listdir(root / leftovers[0])) < len(os.listdir(mgr.path(2)))  # partly deleted (2 gone, owner record added)
    rc, out = cli(["ls", str(root)])
    assert rc == 0
    table = [ln.split()[0] for ln in out.splitlines()[1:] if ln and ln.split()[0].isdigit()]
    assert table == ["2"] and "latest committed: 2" in out
    assert f"skipped {leftovers[0]}: checkpoint being deleted (dead writer" in out
    assert fastckpt.CheckpointManager(root, prefix=prefix).latest() == 2

    if cleaner == "next save":
        fastckpt.CheckpointManager(root, prefix=prefix).save(3, state(3))
        assert mgr.steps() == [2, 3]
    else:
        rc, out = cli(["prune", str(root), "--keep", "5"])
        assert rc == 0 and mgr.steps() == [2]
    assert [n for n in os.listdir(root) if retention.is_temp_name(n)] == []
    got = fastckpt.load(mgr.path(2))
    assert torch.equal(got["w"], state(2)["w"]) and got["step"] == 2
    rc, out = cli(["ls", str(root)])
    assert "skipped" not in out


def test_accelerate_rotation_uses_the_shared_routine(tmp_path):
    from fastckpt.integrations.accelerate.plugin import FastCkptState

    root = tmp_path / "checkpoints"
    mgr = make_root(root, "checkpoint_", (0, 1, 2))
    cfg = SimpleNamespace(automatic_checkpoint_naming=True, total_limit=2)
    FastCkptState(SimpleNamespace(project_configuration=cfg, project_dir=str(tmp_path)))._rotate()
    assert mgr.steps() == [1, 2] and not [n for n in os.listdir(root) if retention.is_temp_name(n)]
