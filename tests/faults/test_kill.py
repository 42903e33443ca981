"""SIGKILL during saves (issue 7, case C6a): the latest commit survives bit-exactly, leftovers get cleaned."""

from __future__ import annotations

import contextlib
import io
import os
import signal

import pytest

import fastckpt
from fastckpt.storage import commit as cm
from fastckpt.cli.main import main as cli_main

from faultkit import (SAVE_OPTS, KillBackend, check_root, fork_writer, kill_campaign, make_state, read_progress,
                      temp_leftovers)


def test_random_sigkill_campaign(tmp_path):
    """>= 10 kills at random moments of a writer saving step after step (keep_last=2).

    The writers go through a paced backend and each kill is timed from the start of the
    writer's first save (see ``kill_campaign``), so at least half of the kills land inside a
    save however fast the disk is or however loaded the machine (measured: 10-12 of 12 on a
    2-core VM with 3 CPU hogs, where unpaced saves timed from the fork gave 3-6).
    """
    st = kill_campaign(str(tmp_path / "run"), iterations=12, seed=7)
    assert st.failures == []
    assert st.kills == 12
    assert st.mid_save >= 6, (f"only {st.mid_save} of 12 kills landed during a save (one save "
                              f"~{st.save_s * 1e3:.0f} ms): the campaign proves nothing")
    assert st.commits_seen + st.cleaned_by_save >= 1


def _kill_at(root: str, method: str, nth: int) -> tuple[set[int], set[int]]:
    pid, rfd = fork_writer(root, 200, backend=KillBackend(method, nth))
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return read_progress(rfd)


@pytest.mark.parametrize("method,nth", [("pwrite", 1), ("pwrite", 5), ("fsync", 2), ("close", 3)])
def test_kill_after_k_of_n_shards(tmp_path, method, nth):
    """C6a: step 100 committed; the writer of step 200 dies after k of n shard files; latest stays 100."""
    root = str(tmp_path / "run")
    fastckpt.CheckpointManager(root).save(100, make_state(100), **SAVE_OPTS)
    started, committed = _kill_at(root, method, nth)
    assert started == {200} and committed == set()
    mgr = fastckpt.CheckpointManager(root)
    assert mgr.latest() == 100 and mgr.steps() == [100]
    check_root(root, 100, {100, 200}, cli=True)
    left = temp_leftovers(root)
    assert left, "the kill should have left the temporary folder of step 200"
    assert all("dead writer" in why for n, why in mgr.skipped() if n in left)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["ls", root]) == 0
    assert "skipped" in out.getvalue() and left[0] in out.getvalue()
    # the next save cleans the leftover, and resume from 100 is bit-exact
    mgr.save(200, make_state(200), **SAVE_OPTS)
    assert temp_leftovers(root) == [] and mgr.steps() == [100, 200]


def test_kill_with_prune_cleans(tmp_path):
    root = str(tmp_path / "run")
    fastckpt.CheckpointManager(root).save(100, make_state(100), **SAVE_OPTS)
    _kill_at(root, "pwrite", 3)
    assert temp_leftovers(root)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["prune", root, "--keep", "5"]) == 0
    assert temp_leftovers(root) == []
    assert fastckpt.CheckpointManager(root).steps() == [100]


def test_leftover_without_owner_record_is_attributed_by_name(tmp_path):
    """A writer killed after removing its owner record (just before the rename) is still known dead."""
    root = tmp_path / "run"
    fastckpt.CheckpointManager(root).save(100, make_state(100), **SAVE_OPTS)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    dead = root / f".step-200{cm.TMP_MARK}{pid}@{cm.host_tag()}-0badc0de"
    dead.mkdir()
    (dead / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 100)
    other_host = root / f".step-300{cm.TMP_MARK}{pid}@ffffffff-0badc0de"
    other_host.mkdir()
    removed = cm.clean_stale_temps(str(root))
    assert removed == [dead.name]
    assert other_host.exists(), "a temporary folder of another host must never be removed"


def test_truncated_newer_folder_without_manifest(tmp_path):
    """C6: a folder that looks like step 300 (truncated shard, no manifest) is never latest; ls says why."""
    root = tmp_path / "run"
    mgr = fastckpt.CheckpointManager(root)
    mgr.save(100, make_state(100), **SAVE_OPTS)
    mgr.save(300, make_state(300), **SAVE_OPTS)
    shard = sorted((root / "step-300").glob("model*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    os.unlink(root / "step-300" / cm.MANIFEST)
    assert mgr.latest() == 100
    with pytest.raises(fastckpt.CheckpointNotFoundError):
        mgr.load(300)
    with pytest.raises(fastckpt.CheckpointNotFoundError):
        fastckpt.load(root / "step-300")
    assert ("step-300" in dict(mgr.skipped()))
    check_root(str(root), 100, {100, 300})


def test_checker_detects_a_damaged_latest(tmp_path):
    """The crash checker itself can fail: a committed latest with other bytes is reported."""
    root = str(tmp_path / "run")
    fastckpt.CheckpointManager(root).save(5, make_state(6), **SAVE_OPTS)  # wrong content for step 5
    with pytest.raises(AssertionError, match="bit-exactly"):
        check_root(root, 5, {5})
    with pytest.raises(AssertionError, match="never saved"):
        check_root(root, None, {4})
