"""Multi-rank saves with ``commit="marker"``: 2 simulated nodes (``FASTCKPT_NODE``), each rank
writing its own "node-local" root; 2 processes spawned inside pytest, gloo over a FileStore."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt
from fastckpt.saving import committer as dist_commit
from fastckpt.manager import committed_steps, newest_common_step
from fastckpt.errors import CheckpointNotFoundError, DistributedSaveError
from fastckpt.storage.io import PosixBackend

CHUNK = 64 << 10


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = {f"w{i}": torch.randn(64 + i, 256, generator=g) for i in range(4)}
    return {"model": model, "step": step,
            "optimizer": {"exp_avg": torch.full((3,), float(rank)), "rank": rank}}


def _root(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"node{rank}")  # this rank's "node-local disk"


def _save(rank: int, tmp: str, step: int, **kw):
    path = os.path.join(_root(tmp, rank), f"step-{step}")
    return fastckpt.save(_state(rank, step), path, commit="marker", local_keys=("optimizer",),
                         process_group=dist.group.WORLD,
                         chunk_bytes=CHUNK, step=step, **kw)


def _check_load(rank: int, tmp: str, step: int) -> bool:
    path = os.path.join(_root(tmp, rank), f"step-{step}")
    got = fastckpt.load(path, keys=["model", "step"])
    mine = fastckpt.load_into({"optimizer": {"exp_avg": torch.zeros(3), "rank": -1}}, path, local_rank=rank)
    want = _state(rank, step)
    return (all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
            and torch.equal(mine["optimizer"]["exp_avg"], want["optimizer"]["exp_avg"])
            and mine["optimizer"]["rank"] == rank and got["step"] == step)


class _FailPwrite(PosixBackend):
    def pwrite(self, fd, data, offset):
        raise OSError(errno.EIO, "injected EIO on rank 1")


def _phase1(rank: int, tmp: str) -> dict:
    out: dict = {}
    # step 1: success on both nodes
    _save(rank, tmp, 1)
    out["ok_load"] = _check_load(rank, tmp, 1)
    out["common_1"] = newest_common_step(_root(tmp, rank))
    # step 2: rank 1 fails while writing -> nothing committed anywhere
    try:
        _save(rank, tmp, 2, io_backend=_FailPwrite() if rank == 1 else None)
        out["fail"] = None
    except DistributedSaveError as e:
        out["fail"] = {str(k): v for k, v in e.failures.items()}
    out["exists_2"] = os.path.exists(os.path.join(_root(tmp, rank), "step-2"))
    # step 3: node 1 wrote its marker, then rank 0 fails to write its own -> node 1's is rolled back
    real = dist_commit.write_metadata
    if rank == 0:
        def boom(*a, **k):
            raise OSError(errno.ENOSPC, "injected ENOSPC writing rank 0's marker")
        dist_commit.write_metadata = boom
    try:
        _save(rank, tmp, 3)
        out["commit_fail"] = None
    except DistributedSaveError as e:
        out["commit_fail"] = {str(k): v for k, v in e.failures.items()}
    finally:
        dist_commit.write_metadata = real
    out["exists_3"] = os.path.exists(os.path.join(_root(tmp, rank), "step-3"))
    out["common_3"] = newest_common_step(_root(tmp, rank))
    with open(os.path.join(tmp, f"out{rank}.json"), "w") as f:
        json.dump(out, f)
    # step 4: rank 0 dies between node 1's marker and its own (a crash of the committer)
    if rank == 0:
        dist_commit.write_metadata = lambda *a, **k: os._exit(0)
    try:
        _save(rank, tmp, 4, timeout_s=3)
        crash = "returned"
    except DistributedSaveError as e:
        crash = f"DistributedSaveError: {e}"
    except TimeoutError as e:
        crash = f"TimeoutError: {e}"
    with open(os.path.join(tmp, f"crash{rank}.json"), "w") as f:
        json.dump({"crash": crash}, f)
    return out


def _phase2(rank: int, tmp: str) -> dict:
    """Restart after the crash: pick the newest step every node committed, load it, save again."""
    out = {"common": newest_common_step(_root(tmp, rank))}
    out["load"] = _check_load(rank, tmp, out["common"])
    _save(rank, tmp, 4, overwrite=True)  # replaces the half-committed step 4 on both nodes
    out["common_after"] = newest_common_step(_root(tmp, rank))
    out["load_after"] = _check_load(rank, tmp, 4)
    with open(os.path.join(tmp, f"restart{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


def _run(rank: int, tmp: str, phase: str) -> None:
    os.environ["FASTCKPT_NODE"] = f"node{rank}"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{phase}", rank=rank, world_size=2)
    try:
        globals()["_" + phase](rank, tmp)
    finally:
        dist.destroy_process_group()  # rank 0 of phase1 never gets here (it "crashes")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("marker")
    snaps = {}
    from fastckpt_testkit import spawn_bounded  # not at module level: the ranks import this module
    spawn_bounded(_run, (str(tmp), "phase1"), 2)
    snaps["after_crash"] = {r: committed_steps(_root(str(tmp), r)) for r in range(2)}
    left = os.path.join(_root(str(tmp), 0), "step-4")
    snaps["rank0_step4"] = sorted(os.listdir(left))
    snaps["rank0_step4_load"] = []
    for fn in (fastckpt.load, lambda p: fastckpt.load_into({}, p)):  # a node folder without its marker is no checkpoint
        try:
            fn(left)
            snaps["rank0_step4_load"].append("loaded")
        except CheckpointNotFoundError as e:
            snaps["rank0_step4_load"].append(f"not found: {e}")
    snaps["rank0_step4_committed"] = fastckpt.is_committed(left)
    from fastckpt_testkit import spawn_bounded  # not at module level: the ranks import this module
    spawn_bounded(_run, (str(tmp), "phase2"), 2)
    return tmp, snaps


def _outs(tmp, name: str) -> list[dict]:
    return [json.load(open(tmp / f"{name}{r}.json")) for r in range(2)]


def test_success_each_node_folder_and_marker_last(spawned):
    tmp, _ = spawned
    out = _outs(tmp, "out")
    assert all(o["ok_load"] for o in out)  # each node loads its own folder
    assert [o["common_1"] for o in out] == [1, 1]
    m = [fastckpt.read_manifest(str(tmp / f"node{r}" / "step-1")) for r in range(2)]
    for r in range(2):
        d = m[r].distributed
        assert d.mode == "marker" and d.node == f"node{r}" and d.nodes == ["node0", "node1"]
        assert m[r].world_size == 2 and m[r].step == 1
        # each node's folder holds the replicated files and its own rank's files only
        assert list(d.rank_local_skeletons) == [r]
        assert fastckpt.verify(tmp / f"node{r}" / "step-1").ok
    # rank 0's marker is written last, after node 1 acknowledged its own
    assert m[0].created_unix_s >= m[1].created_unix_s
    assert (tmp / "node0" / "step-1" / "manifest.json").stat().st_mtime_ns >= \
        (tmp / "node1" / "step-1" / "manifest.json").stat().st_mtime_ns
    # rank 1's replicated bytes read back from node 1's folder alone
    one = fastckpt.load(tmp / "node1" / "step-1", keys=["model"])
    assert all(torch.equal(one["model"][k], v) for k, v in _state(1, 1)["model"].items())


def test_one_rank_fails_no_marker_anywhere(spawned):
    tmp, _ = spawned
    out = _outs(tmp, "out")
    for o in out:
        assert o["fail"] is not None and list(o["fail"]) == ["1"] and "injected EIO" in o["fail"]["1"], o
        assert not o["exists_2"]
    for r in range(2):
        assert not (tmp / f"node{r}" / "step-2").exists()


def test_rank0_marker_failure_rolls_back_other_nodes(spawned):
    tmp, _ = spawned
    out = _outs(tmp, "out")
    for o in out:
        assert o["commit_fail"] is not None and list(o["commit_fail"]) == ["0"], o
        assert "injected ENOSPC" in o["commit_fail"]["0"]
        assert not o["exists_3"] and o["common_3"] == 1


def test_crash_between_markers_leaves_step_uncommitted(spawned):
    tmp, snaps = spawned
    crash = json.load(open(tmp / "crash1.json"))["crash"]
    assert crash.startswith("DistributedSaveError") and "commit" in crash and "rank 0" in crash, crash
    assert not (tmp / "crash0.json").exists()  # rank 0 died inside the commit
    # node 1 has its marker for step 4, node 0 has the files but no marker
    assert snaps["after_crash"] == {0: [1], 1: [1, 4]}
    assert "manifest.json" not in snaps["rank0_step4"] and "model.safetensors" in snaps["rank0_step4"]
    assert not snaps["rank0_step4_committed"]
    assert all(x.startswith("not found") and "never committed" in x for x in snaps["rank0_step4_load"]), snaps
    restart = _outs(tmp, "restart")
    assert [o["common"] for o in restart] == [1, 1] and all(o["load"] for o in restart)
    assert [o["common_after"] for o in restart] == [4, 4] and all(o["load_after"] for o in restart)


def test_newest_common_step_one_process(tmp_path):
    (tmp_path / "step-5").mkdir()  # no marker: not committed
    assert committed_steps(tmp_path) == []
    assert newest_common_step(tmp_path) is None
    fastckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "step-3")
    assert committed_steps(tmp_path) == [3]
    assert newest_common_step(tmp_path) == 3  # one process: its own root
