"""Multi-rank saves: 2 processes spawned inside pytest, gloo over a FileStore."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt
from fastckpt.saving.ranks import partition_units
from fastckpt.coordination import LOCAL
from fastckpt.errors import DistributedSaveError
from fastckpt.storage.io import PosixBackend
from fastckpt.format.layout import ArraySpec, plan_save

CHUNK = 64 << 10


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(64 + i, 256, generator=g) for i in range(6)}
    model["b"] = torch.arange(10, dtype=torch.int64)
    return {"model": model, "step": 7, "lr": [0.1, 0.2]}


class _FailPwrite(PosixBackend):
    def pwrite(self, fd, data, offset):
        raise OSError(errno.EIO, "injected EIO on rank 1")


SCENARIOS = ("replicated", "local", "fail")


def _run(rank: int, tmp: str) -> None:
    """One spawn runs every scenario in its own folder (spawning costs ~10 s on 2 cores)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        for scenario in SCENARIOS:
            folder = os.path.join(tmp, scenario)
            if rank == 0:
                os.makedirs(folder)
            dist.barrier()
            out = globals()["_scn_" + scenario](rank, folder)
            with open(os.path.join(folder, f"out{rank}.json"), "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _scn_replicated(rank: int, tmp: str) -> dict:
    fut = fastckpt.async_save(_state(rank), os.path.join(tmp, "ck"), chunk_bytes=CHUNK, step=7,
                              process_group=dist.group.WORLD)
    staged = fut.wait_staged(0)  # multi-rank saves copy at the call (a Trainer step gate never hangs)
    dist.all_reduce(torch.ones(1))  # training collectives while the save runs in the background
    fut.result()
    back = fastckpt.load(os.path.join(tmp, "ck"))
    ok = staged and all(torch.equal(back["model"][k], v) for k, v in _state(rank)["model"].items())
    return {"bytes": fut.bytes_by_rank[rank], "total": fut.bytes_written, "ok": ok}


def _scn_local(rank: int, tmp: str) -> dict:
    state = {"model": {"w": torch.ones(4)},
             "optimizer": {"exp_avg": torch.full((3,), float(rank)), "rank": rank}}
    mgr = fastckpt.CheckpointManager(os.path.join(tmp, "run"), keep_last=1, process_group=dist.group.WORLD)
    mgr.save(1, state, local_keys=("optimizer",), chunk_bytes=CHUNK)
    mgr.save(2, state, local_keys=("optimizer",), chunk_bytes=CHUNK)
    got = fastckpt.load_into({"optimizer": {"exp_avg": torch.zeros(3), "rank": -1}}, mgr.path(2), local_rank=rank)
    return {"steps": mgr.steps(), "opt_rank": got["optimizer"]["rank"],
            "exp_avg": got["optimizer"]["exp_avg"].tolist()}


def _scn_fail(rank: int, tmp: str) -> dict:
    be = _FailPwrite() if rank == 1 else None
    try:
        fastckpt.save(_state(rank), os.path.join(tmp, "ck"), chunk_bytes=CHUNK, io_backend=be,
                      process_group=dist.group.WORLD)
    except DistributedSaveError as e:
        return {"failures": {str(k): v for k, v in e.failures.items()}, "cause": type(e.__cause__).__name__}
    return {"failures": None}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    from fastckpt_testkit import spawn_bounded  # not at module level: the ranks import this module
    spawn_bounded(_run, (str(tmp),), 2)
    return tmp


def _out(spawned, scenario: str):
    folder = spawned / scenario
    return [json.load(open(folder / f"out{r}.json")) for r in range(2)], folder


def test_replicated_split_each_rank_writes_about_half(spawned):
    out, tmp_path = _out(spawned, "replicated")
    assert all(o["ok"] for o in out)
    m = fastckpt.read_manifest(str(tmp_path / "ck"))
    assert m.world_size == 2 and m.distributed.mode == "rename"
    b0, b1 = out[0]["bytes"], out[1]["bytes"]
    assert out[0]["total"] == out[1]["total"] >= b0 + b1  # every rank learns the checkpoint's size
    assert abs(b0 - b1) <= 2 * CHUNK + 64 * 1024, (b0, b1)
    assert max(b0, b1) < 0.6 * (b0 + b1)
    # the files are plain safetensors an HF reader loads (written by both ranks)
    from safetensors.torch import load_file
    names = [n for n in m.files if n.endswith(".safetensors")]
    assert any(len(m.distributed.written_by[n]) == 2 for n in names) or len(names) > 1
    loaded = {}
    for n in names:
        loaded.update(load_file(str(tmp_path / "ck" / n)))
    assert torch.equal(loaded["w3"], _state(0)["model"]["w3"])
    assert fastckpt.verify(tmp_path / "ck").ok


def test_rank_local_subtrees(spawned):
    out, tmp_path = _out(spawned, "local")
    assert out[0]["steps"] == [2] and out[1]["steps"] == [2]  # keep_last=1 pruned by rank 0 only
    assert [o["opt_rank"] for o in out] == [0, 1] and out[1]["exp_avg"] == [1.0, 1.0, 1.0]
    ck = tmp_path / "run" / "step-2"
    m = fastckpt.read_manifest(str(ck))
    assert sorted(m.distributed.rank_local_skeletons) == [0, 1]
    assert (tmp_path / "run" / "latest").read_text().strip() == "2"
    assert torch.equal(fastckpt.load(ck, keys=["model"])["model"]["w"], torch.ones(4))
    one = fastckpt.load_into({"optimizer": {"exp_avg": torch.zeros(3), "rank": -1}}, ck, local_rank=1)
    assert one["optimizer"]["rank"] == 1
    assert fastckpt.verify(ck).ok


def test_one_rank_fails_nothing_committed(spawned):
    out, tmp_path = _out(spawned, "fail")
    for o in out:
        assert o["failures"] is not None and list(o["failures"]) == ["1"], o
        assert "injected EIO" in o["failures"]["1"]
    assert out[1]["cause"] == "OSError"
    assert not (tmp_path / "ck").exists()
    assert not [n for n in os.listdir(tmp_path) if "fastckpt-tmp" in n]


def test_partition_units_balanced():
    specs = [ArraySpec(f"k{i}", f"k{i}", "model", "F32", (1000 + 10 * i,), 4000 + 40 * i) for i in range(50)]
    plan = plan_save(specs, max_shard_bytes=10**9, chunk_bytes=4096)
    runs = partition_units(plan, 3)
    sizes = [sum(u.nbytes for u in plan.units[a:b]) for a, b in runs]
    assert runs[0][0] == 0 and runs[-1][1] == len(plan.units)
    assert max(sizes) - min(sizes) <= 2 * 4096


def test_single_process_is_plain_path(tmp_path):
    p = fastckpt.save({"model": {"w": torch.ones(3)}}, tmp_path / "a")
    assert fastckpt.read_manifest(str(p)).distributed is None
    assert torch.equal(fastckpt.load(p)["model"]["w"], torch.ones(3))
