"""Two independent jobs on one CheckpointManager root (issue 7): a lock or a clear error, never
interleaved files, and cleaning never removes a live writer's temporary folder."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch

import fastckpt
from fastckpt.storage import commit as cm
from fastckpt.cli.main import main as cli_main
from fastckpt.errors import CheckpointLockedError
from fastckpt.storage.io import PosixBackend

from faultkit import SAVE_OPTS, make_state, same_state, temp_leftovers


def _fork(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.set_num_threads(1)
            fn()
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    return pid


def _job(root: str, job: int, steps, timeout_s: float, log: str) -> None:
    mgr = fastckpt.CheckpointManager(root, keep_last=None, lock_timeout_s=timeout_s)
    with open(log, "w") as f:
        for s in steps:
            try:
                mgr.save(s, make_state(s + 1000 * job), **SAVE_OPTS)
                f.write(f"C {s}\n")
            except CheckpointLockedError:
                f.write(f"L {s}\n")
            f.flush()


def _run_two_jobs(tmp_path, timeout_s: float):
    root = str(tmp_path / "run")
    os.makedirs(root)
    logs = [str(tmp_path / f"job{j}.log") for j in (1, 2)]
    pids = [_fork(lambda j=j: _job(root, j, range(j, 24, 2), timeout_s, logs[j - 1])) for j in (1, 2)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    outcome = {}
    for j, log in enumerate(logs, 1):
        for line in open(log).read().split("\n"):
            if line:
                kind, s = line.split()
                outcome[int(s)] = (j, kind)
    mgr = fastckpt.CheckpointManager(root)
    for s in mgr.steps():  # each committed folder is exactly one job's state: never interleaved
        j, kind = outcome[s]
        assert kind == "C"
        assert fastckpt.verify(mgr.path(s)).ok
        assert same_state(make_state(s + 1000 * j), mgr.load(s)) is None, f"step {s} mixes jobs"
    assert sorted(s for s, (_, k) in outcome.items() if k == "C") == mgr.steps()
    assert temp_leftovers(root) == []
    return outcome


def test_two_jobs_without_waiting_get_clear_errors(tmp_path):
    outcome = _run_two_jobs(tmp_path, timeout_s=0.0)
    kinds = [k for _, k in outcome.values()]
    assert "C" in kinds
    # both jobs really overlapped on this machine in practice; a lock error is the only other outcome
    assert set(kinds) <= {"C", "L"}


def test_two_jobs_with_lock_timeout_serialize(tmp_path):
    outcome = _run_two_jobs(tmp_path, timeout_s=30.0)
    assert all(k == "C" for _, k in outcome.values()) and len(outcome) == 23


class _Gate(PosixBackend):
    """Blocks the first fsync until ``flag`` exists (a writer that is alive but slow)."""

    def __init__(self, flag: str):
        self.flag = flag

    def fsync(self, fd):
        while not os.path.exists(self.flag):
            time.sleep(0.01)
        super().fsync(fd)


def test_cleaning_never_removes_a_live_writers_temp(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    fastckpt.CheckpointManager(root).save(1, make_state(1), **SAVE_OPTS)
    flag = str(tmp_path / "go")
    pid = _fork(lambda: fastckpt.CheckpointManager(root).save(2, make_state(2), io_backend=_Gate(flag),
                                                              **SAVE_OPTS))
    try:
        deadline = time.monotonic() + 30
        while not temp_leftovers(root):
            assert time.monotonic() < deadline, "writer never started"
            time.sleep(0.01)
        live = temp_leftovers(root)
        assert cm.clean_stale_temps(root) == []
        other = fastckpt.CheckpointManager(root)
        with pytest.raises(CheckpointLockedError, match=f"pid {pid}"):
            other.prune(1)
        with pytest.raises(CheckpointLockedError) as ei:
            other.save(3, make_state(3), **SAVE_OPTS)
        assert "another rank of this job" not in str(ei.value)
        monkeypatch.setenv("WORLD_SIZE", "2")  # the usual DDP mistake: every rank owns a manager of one root
        with pytest.raises(CheckpointLockedError, match="another rank of this job.*rank 0"):
            other.save(3, make_state(3), **SAVE_OPTS)
        monkeypatch.delenv("WORLD_SIZE")
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert cli_main(["prune", root, "--keep", "1"]) == 2
        assert "another job is writing" in err.getvalue()
        assert temp_leftovers(root) == live, "a live writer's temporary folder was touched"
        assert all("live writer" in why for n, why in other.skipped() if n in live)
        assert other.steps() == [1] and not os.path.exists(other.path(3))
    finally:
        open(flag, "w").close()
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    mgr = fastckpt.CheckpointManager(root)
    assert mgr.steps() == [1, 2] and temp_leftovers(root) == []
    assert same_state(make_state(2), mgr.load()) is None
    mgr.save(3, make_state(3), **SAVE_OPTS)  # the lock died with the writer
