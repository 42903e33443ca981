"""DTensor states saved by fastckpt.save / async_save on 2 spawned ranks (gloo, CPU): one committed
folder of full tensors, each rank writing its own chunks (uneven shards, Shard(0)/Shard(1)/Replicate,
O_DIRECT), byte-for-byte the files of a one-process save of the full tensors; failures commit nothing."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ranks import RankPool  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.storage.io import PosixBackend, memory_backed  # noqa: E402

TIMEOUT_S = 120
TMP_MARK = ".fastckpt-tmp-"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("dtpool")), world_size=2)
    yield p
    p.close()


# -- rank functions (run in the spawned ranks) ------------------------------------------------

def _full_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"a.weight": torch.randn(7, 33, generator=g),          # Shard(0): 4 + 3 rows of 132 bytes
                  "b.weight": torch.randn(5, 37, generator=g),          # Shard(1): 19 + 18 cols, rows of 148 bytes
                  "c.weight": torch.randn(3001, 7, generator=g),        # Shard(0), edges inside pages
                  "d.weight": torch.randn(64, 1001, generator=g).half(),  # Shard(1), rows of 2002 bytes
                  "e.bias": torch.randn(3, 3, generator=g).double(),    # Replicate()
                  "f.weight": torch.randn(9, 5, generator=g),           # 2-D mesh (1, 2): Replicate(), Shard(0)
                  "plain": torch.arange(10)},                          # a plain tensor: one rank writes it
        "step": 3, "note": "uneven", "scalar": torch.tensor(2.5)}


def _distribute(full: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    mesh2 = init_device_mesh("cpu", (1, 2))
    m = full["model"]
    place = {"a.weight": (mesh, [Shard(0)]), "b.weight": (mesh, [Shard(1)]), "c.weight": (mesh, [Shard(0)]),
             "d.weight": (mesh, [Shard(1)]), "e.bias": (mesh, [Replicate()]),
             "f.weight": (mesh2, [Replicate(), Shard(0)])}
    out = dict(full)
    out["model"] = {k: (distribute_tensor(v, *place[k]) if k in place else v) for k, v in m.items()}
    return out


class _Recording(PosixBackend):
    """Records (file name, offset, bytes) of every pwrite this rank makes, and how it created files."""

    def __init__(self):
        self.writes, self.sized = [], []

    def allocate(self, fd, nbytes):
        self.sized.append(("allocate", nbytes))
        super().allocate(fd, nbytes)

    def set_size(self, fd, nbytes):
        self.sized.append(("set_size", nbytes))
        super().set_size(fd, nbytes)

    def pwrite(self, fd, data, offset):
        n = super().pwrite(fd, data, offset)
        self.writes.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n))
        return n


def rank_save_uneven(folder: str, o_direct: bool) -> dict:
    state = _distribute(_full_state())
    be = _Recording()
    fut = fastckpt.async_save(state, os.path.join(folder, "ck"), o_direct=o_direct, timeout_s=60, io_backend=be)
    fut.result(timeout_s=90)
    return {"bytes_by_rank": fut.bytes_by_rank, "writes": be.writes, "sized": be.sized}


def _big_state() -> dict:
    """Chunks large enough to be written from their own memory by a blocking save (runs >= 64 KiB),
    one of them with its rank boundary inside a page (head bytes handed to the other rank)."""
    g = torch.Generator().manual_seed(1)
    return {"model": {"a.weight": torch.randn(4099, 33, generator=g),   # Shard(0): 2050 + 2049 rows of 132 bytes
                      "b.weight": torch.randn(1024, 256, generator=g),  # Shard(0): 512 rows each, page aligned
                      "c.bias": torch.randn(8, generator=g)},          # a plain tensor: one rank writes it
            "step": 7}


def rank_blocking_save_from_memory(folder: str, o_direct: bool, change: bool) -> dict:
    """fastckpt.save (blocking) of a DTensor state; counts the saver's staging-pool acquisitions. With
    ``change``, rank 1's first pwrite changes its chunk of ``a.weight`` in place (as another thread would)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch.distributed as dist
    from fastckpt.storage.staging import StagingPool
    mesh = init_device_mesh("cpu", (2,))
    full = _big_state()
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) if k != "c.bias" else v
                       for k, v in full["model"].items()}, "step": 7}
    acquired = []
    orig = StagingPool.acquire

    def counting(self, *a, **kw):
        acquired.append(a[0] if a else kw)
        return orig(self, *a, **kw)

    class Changing(_Recording):
        def pwrite(self, fd, data, offset):
            if change and dist.get_rank() == 1 and not self.writes:
                state["model"]["a.weight"].to_local().add_(1)
            return super().pwrite(fd, data, offset)
    be = Changing()
    StagingPool.acquire = counting
    out = {}
    try:
        try:
            fastckpt.save(state, os.path.join(folder, "ck"), o_direct=o_direct, timeout_s=60, io_backend=be)
            out["error"] = None
        except Exception as e:
            out["error"], out["message"] = type(e).__name__, str(e)
        out["acquired_blocking"] = len(acquired)
        dist.barrier()
        fastckpt.async_save(state, os.path.join(folder, "ck-async"), o_direct=o_direct, timeout_s=60).result(90)
        out["acquired_async"] = len(acquired) - out["acquired_blocking"]
    finally:
        StagingPool.acquire = orig
    out["writes"] = be.writes
    out["leftovers"] = sorted(n for n in os.listdir(folder) if TMP_MARK in n)
    return out


def _split_state() -> dict:
    """32 MiB of weights (4 x 8 MiB fp32): two writers get a file each (16 MiB, the split's minimum)."""
    g = torch.Generator().manual_seed(2)
    return {"model": {f"l{i}.weight": torch.randn(2048, 1024, generator=g) for i in range(4)}, "step": 1}


def rank_save_split(folder: str, dcp_dropin: bool) -> dict:
    """Save :func:`_split_state` as Shard(0) DTensors (fastckpt.save, or dcp.save with FastCkptWriter)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _split_state()["model"].items()},
             "step": 1}
    be = _Recording()
    path = os.path.join(folder, "ck")
    if dcp_dropin:
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastCkptWriter
        dcp.save(state, storage_writer=FastCkptWriter(path, io_backend=be))
    else:
        fastckpt.save(state, path, timeout_s=60, io_backend=be)
    return {"files_written": sorted({f for f, _, _ in be.writes})}


@pytest.mark.parametrize("dcp_dropin", [False, True])
def test_two_ranks_write_a_weights_file_each(pool, tmp_path, dcp_dropin):
    """A stem that both ranks write is cut into two files, and the ranks start at different files (so they
    write different files at once instead of taking turns at one file's write lock: each still writes its
    half of every tensor, in both files); the files are ordinary sharded weights: safetensors and the
    index read them."""
    res = pool.run(rank_save_split, folder=str(tmp_path), dcp_dropin=dcp_dropin, timeout_s=TIMEOUT_S)
    ck = tmp_path / "ck"
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in ck.glob("model*.safetensors")) == names
    for r in (0, 1):  # Shard(0) of every tensor: each rank writes its half of every tensor, in both files
        assert res[r]["files_written"] == names, res[r]
    index = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    full = _split_state()["model"]
    assert sorted(set(index.values())) == names and set(index) == set(full)
    got = _read_all(ck)
    back = fastckpt.load(ck)
    for k, v in full.items():
        assert torch.equal(got[k], v) and torch.equal(back["model"][k], v), k


class _FailingBackend(PosixBackend):
    def pwrite(self, fd, data, offset):
        raise OSError(5, "injected EIO")


def rank_save_failing(folder: str) -> dict:
    import torch.distributed as dist
    state = _distribute(_full_state())
    path = os.path.join(folder, "bad")
    kw = {"io_backend": _FailingBackend()} if dist.get_rank() == 1 else {}
    out = {}
    try:
        fastckpt.save(state, path, timeout_s=30, **kw)
        out["error"] = None
    except Exception as e:
        out["error"] = type(e).__name__
        out["failures"] = sorted(getattr(e, "failures", {}) or {})
        out["message"] = str(e)
    dist.barrier()
    out["exists_after_fail"] = os.path.exists(path)
    out["leftovers"] = sorted(n for n in os.listdir(folder) if TMP_MARK in n)
    fastckpt.save(state, path, timeout_s=30)  # the process stays usable
    out["ok_after"] = os.path.exists(os.path.join(path, "manifest.json"))
    return out


def rank_failing_on_rank1(folder: str, where: str) -> dict:
    """Rank 1 fails where ``where`` says; rank 0 must fail at once, not after ``timeout_s``:

    - ``"edge"``: in the background, before handing over its edge bytes (rank 0 waits for them);
    - ``"call"``: at the call, copying to host memory (rank 0 must not create and write the files alone).
    Then every rank saves the same path again: the process stays usable, no stale store keys."""
    import time

    import torch.distributed as dist
    from fastckpt.saving import pages
    owner, name, exc = ((pages.PageJob, "send_edges", RuntimeError("injected staging failure")) if where == "edge"
                        else (pages.PageJob, "stage", MemoryError("injected host-buffer failure")))
    state = _distribute(_full_state())
    path = os.path.join(folder, f"bad-{where}")
    orig = getattr(owner, name)
    if dist.get_rank() == 1:
        def bad(self, *a, **kw):
            raise exc
        setattr(owner, name, bad)
    t = time.monotonic()
    try:
        fastckpt.async_save(state, path, timeout_s=60).result(60)
        out = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "failures": sorted(getattr(e, "failures", {}) or {}), "message": str(e)}
    finally:
        setattr(owner, name, orig)
    out["seconds"] = time.monotonic() - t
    dist.barrier()
    out["exists"] = os.path.exists(path)
    out["leftovers"] = sorted(n for n in os.listdir(folder) if TMP_MARK in n)
    fastckpt.save(state, path, timeout_s=60)
    out["ok_after"] = fastckpt.is_committed(path)
    return out


def rank_refuse(folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    class Sub(torch.Tensor):
        pass

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    cases = {"partial": {"model": {"w": DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])}},
             "subclass": {"model": {"w": DTensor.from_local(torch.ones(4, 4), mesh, [__import__(
                 "torch.distributed.tensor", fromlist=["Shard"]).Shard(0)]), "x": torch.Tensor._make_subclass(Sub, torch.ones(2))}}}
    for name, state in cases.items():
        path = os.path.join(folder, name)
        try:
            fastckpt.save(state, path)
            out[name] = None
        except Exception as e:
            out[name] = (type(e).__name__, str(e), os.path.exists(path),
                         sorted(n for n in os.listdir(folder) if TMP_MARK in n))
    return out


def rank_manager(folder: str, group: bool) -> dict:
    """CheckpointManager with a DTensor state: with process_group=WORLD, and without one (the
    meshes' ranks save together; their rank 0 alone locks the root, prunes and writes latest);
    then the resume path: load_into a zeroed DTensor state of the same placements."""
    import torch.distributed as dist
    state = _distribute(_full_state())
    mgr = fastckpt.CheckpointManager(os.path.join(folder, "run"), keep_last=1,
                                     process_group=dist.group.WORLD if group else None)
    mgr.save(1, state, timeout_s=60)
    state["step"] = 2
    mgr.save(2, state, timeout_s=60)
    dist.barrier()
    fresh = _distribute({**_full_state(), "step": 0})
    for t in fresh["model"].values():
        (t.to_local() if hasattr(t, "to_local") else t).zero_()
    back = mgr.load_into(fresh)
    bad = [k for k, v in _full_state()["model"].items()
           if not torch.equal(fresh["model"][k].full_tensor() if hasattr(fresh["model"][k], "full_tensor")
                              else fresh["model"][k], v)]
    return {"steps": mgr.steps(), "latest": mgr.latest(), "bad": bad, "step": back["step"]}


# -- tests --------------------------------------------------------------------------------------

def _read_all(path: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture
def memory_tier():
    """A folder on a memory-backed file system (/dev/shm), removed afterwards."""
    if not (os.path.isdir("/dev/shm") and memory_backed("/dev/shm")):
        pytest.skip("/dev/shm is not a tmpfs here")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="fastckpt-test-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("o_direct,tier", [(True, "disk"), (False, "disk"), (True, "memory")])
def test_uneven_shards_bytes_exact(pool, tmp_path, request, o_direct, tier):
    folder = tmp_path if tier == "disk" else request.getfixturevalue("memory_tier")
    res = pool.run(rank_save_uneven, folder=str(folder), o_direct=o_direct, timeout_s=TIMEOUT_S)
    ck = folder / "ck"
    full = _full_state()
    # rank 0 creates every file at its final size: preallocated on a disk, only sized (sparse) on tmpfs,
    # where preallocating all ranks' bytes on one rank zero-fills every page before anyone writes
    assert res[0]["sized"] and {how for how, _ in res[0]["sized"]} == {"allocate" if tier == "disk" else "set_size"}
    assert not res[1]["sized"]
    # the files are byte-for-byte those of a one-process save of the full tensors
    ref = tmp_path / "ref"
    fastckpt.save(full, ref)
    names = sorted(p.name for p in ref.iterdir() if p.name != "manifest.json")
    assert sorted(p.name for p in ck.iterdir() if p.name != "manifest.json") == names
    for n in names:
        assert (ck / n).read_bytes() == (ref / n).read_bytes(), n
    assert sorted(n for _, n in res[0]["sized"]) == sorted((ck / n).stat().st_size for n in names
                                                           if n.endswith(".safetensors"))
    got = _read_all(ck)
    for k, v in full["model"].items():
        assert torch.equal(got[k], v), k
    m = json.loads((ck / "manifest.json").read_text())
    assert m["format_version"] == 2
    t = m["tensors"]
    for k in ("a.weight", "b.weight", "c.weight", "d.weight", "f.weight"):
        key = "model/" + k
        assert "xxh3" not in t[key] and len(t[key]["chunks"]) == 2, (k, t[key])
    assert t["model/b.weight"]["placement"] == {"mesh_shape": [2], "placements": ["Shard(1)"]}
    assert t["model/f.weight"]["placement"] == {"mesh_shape": [1, 2], "placements": ["Replicate()", "Shard(0)"]}
    assert t["model/b.weight"]["chunks"][1]["offsets"] == [0, 19]
    assert t["model/b.weight"]["chunks"][1]["shape"] == [5, 18]
    import xxhash
    c = t["model/d.weight"]["chunks"][1]
    region = full["model"]["d.weight"][:, c["offsets"][1]:c["offsets"][1] + c["shape"][1]].contiguous()
    assert c["xxh3"] == xxhash.xxh3_64(region.numpy().tobytes()).hexdigest()
    for k in ("model/e.bias", "model/plain", "scalar"):  # written by one rank, one checksum
        assert "chunks" not in t[k] and t[k]["xxh3"] == json.loads((ref / "manifest.json").read_text())["tensors"][k]["xxh3"]
    by_rank = m["distributed"]["bytes_by_rank"]
    assert set(by_rank) == {"0", "1"} and all(b > 0 for b in by_rank.values())
    assert res[0]["bytes_by_rank"] == {0: by_rank["0"], 1: by_rank["1"]}
    # one writer per 4 KiB page: no page of any file is written by both ranks
    pages = {r: {(f, p) for f, off, n in res[r]["writes"] for p in range(off // 4096, (off + n - 1) // 4096 + 1)}
             for r in (0, 1)}
    assert pages[0] and pages[1] and not pages[0] & pages[1], sorted(pages[0] & pages[1])[:5]
    assert sum(n for _, _, n in res[1]["writes"]) == by_rank["1"]
    back = fastckpt.load(ck)
    assert back["step"] == 3 and back["note"] == "uneven" and torch.equal(back["scalar"], full["scalar"])
    for k, v in full["model"].items():
        assert torch.equal(back["model"][k], v), k


@pytest.mark.parametrize("tier", ["disk, o_direct=False", "memory"])
def test_blocking_save_writes_dtensor_chunks_from_their_own_memory(pool, tmp_path, request, tier):
    """Where the files take buffered writes (a memory tier, or o_direct=False), fastckpt.save copies
    no chunk into staging memory: each rank writes its chunks from the tensors' memory (one page, one
    writer, as before) and the files are those of a one-process save; async_save still stages."""
    folder = tmp_path if tier.startswith("disk") else request.getfixturevalue("memory_tier")
    res = pool.run(rank_blocking_save_from_memory, folder=str(folder), o_direct=False if tier.startswith("disk") else None,
                   change=False, timeout_s=TIMEOUT_S)
    for r in (0, 1):
        assert res[r]["error"] is None, res[r]
        assert res[r]["acquired_blocking"] == 0, res[r]  # no staging buffer: nothing copied
        assert res[r]["acquired_async"] >= 1, res[r]     # async_save must copy before it returns
    ref = tmp_path / "ref"
    fastckpt.save(_big_state(), ref)
    names = sorted(p.name for p in ref.iterdir() if p.name != "manifest.json")
    for ck in (folder / "ck", folder / "ck-async"):
        assert sorted(p.name for p in ck.iterdir() if p.name != "manifest.json") == names
        for n in names:
            assert (ck / n).read_bytes() == (ref / n).read_bytes(), (ck, n)
    pages = {r: {(f, p) for f, off, n in res[r]["writes"] for p in range(off // 4096, (off + n - 1) // 4096 + 1)}
             for r in (0, 1)}
    assert pages[0] and pages[1] and not pages[0] & pages[1], sorted(pages[0] & pages[1])[:5]
    back = fastckpt.load(folder / "ck")  # checksums checked
    for k, v in _big_state()["model"].items():
        assert torch.equal(back["model"][k], v), k


def test_blocking_save_of_a_chunk_changed_during_its_writes_commits_nothing(pool, tmp_path):
    res = pool.run(rank_blocking_save_from_memory, folder=str(tmp_path), o_direct=False, change=True,
                   timeout_s=TIMEOUT_S)
    for r in (0, 1):  # a failure in the background (the writes) fails every rank with rank 1's error
        assert res[r]["error"] == "DistributedSaveError", res[r]
        assert "SourceChangedError" in res[r]["message"] and "'model/a.weight'" in res[r]["message"], res[r]
        assert res[r]["leftovers"] == [], res[r]
    assert not (tmp_path / "ck").exists()


def test_failing_rank_commits_nothing(pool, tmp_path):
    res = pool.run(rank_save_failing, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r in (0, 1):
        assert res[r]["error"] == "DistributedSaveError", res[r]
        assert 1 in res[r]["failures"] and "injected EIO" in res[r]["message"], res[r]
        assert not res[r]["exists_after_fail"] and res[r]["leftovers"] == []
        assert res[r]["ok_after"]
    assert torch.equal(fastckpt.load(tmp_path / "bad")["model"]["b.weight"], _full_state()["model"]["b.weight"])


def test_unsupported_values_refused_before_any_file(pool, tmp_path):
    res = pool.run(rank_refuse, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r in (0, 1):
        typ, msg, exists, leftovers = res[r]["partial"]
        assert typ == "UnsupportedValueError" and "'model/w'" in msg and "Partial" in msg
        assert not exists and leftovers == []
        typ, msg, exists, leftovers = res[r]["subclass"]
        assert typ == "UnsupportedValueError" and "'model/x'" in msg and "Sub" in msg
        assert not exists and leftovers == []


@pytest.mark.parametrize("group", [True, False])
def test_checkpoint_manager_saves_dtensor_state(pool, tmp_path, group):
    res = pool.run(rank_manager, folder=str(tmp_path), group=group, timeout_s=TIMEOUT_S)
    assert res[0] == res[1] == {"steps": [2], "latest": 2, "bad": [], "step": 2}
    back = fastckpt.load(tmp_path / "run" / "step-2")
    full = _full_state()
    assert back["step"] == 2
    for k, v in full["model"].items():
        assert torch.equal(back["model"][k], v), k
    assert json.loads((tmp_path / "run" / "step-2" / "manifest.json").read_text())["step"] == 2


def test_rank_failing_before_its_edge_bytes_fails_every_rank_at_once(pool, tmp_path):
    res = pool.run(rank_failing_on_rank1, folder=str(tmp_path), where="edge", timeout_s=TIMEOUT_S)
    for r in (0, 1):
        assert res[r]["error"] == "DistributedSaveError" and 1 in res[r]["failures"], res[r]
        assert "injected staging failure" in res[r]["message"]
        assert res[r]["seconds"] < 30, res[r]  # not the 60 s timeout_s: the failure marker reached rank 0
        assert not res[r]["exists"] and res[r]["leftovers"] == []
        assert res[r]["ok_after"], res[r]


def test_rank_failing_at_the_call_fails_every_rank_at_once(pool, tmp_path):
    """Without a vote at the call, rank 0 would wait in DCP's collectives for the group's timeout."""
    res = pool.run(rank_failing_on_rank1, folder=str(tmp_path), where="call", timeout_s=TIMEOUT_S)
    assert res[1]["error"] == "MemoryError" and "injected host-buffer failure" in res[1]["message"], res[1]
    assert res[0]["error"] == "DistributedSaveError" and res[0]["failures"] == [1], res[0]
    assert "injected host-buffer failure" in res[0]["message"] and "rank 1" in res[0]["message"]
    for r in (0, 1):
        assert res[r]["seconds"] < 30, res[r]  # not the 60 s timeout_s
        assert not res[r]["exists"] and res[r]["leftovers"] == [], res[r]
        assert res[r]["ok_after"], res[r]
    assert torch.equal(fastckpt.load(tmp_path / "bad-call")["model"]["b.weight"], _full_state()["model"]["b.weight"])


def _background_group_after_reinit(folder: str) -> dict:
    import torch.distributed as dist

    from fastckpt.saving.dtensor import background_group
    rank, world = dist.get_rank(), dist.get_world_size()
    first = background_group()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{folder}/reinit-store", rank=rank, world_size=world)
    second = background_group()
    t = torch.ones(1)
    dist.all_reduce(t, group=second)
    return {"same": second is first, "ranks": dist.get_process_group_ranks(second), "sum": t.item()}


def test_background_group_is_new_after_the_world_is_destroyed(tmp_path):
    """A notebook or elastic restart that calls ``destroy_process_group()`` and ``init_process_group()``
    again must get a gloo group of the new world, not the cached group of the destroyed one."""
    (tmp_path / "pool").mkdir()
    p = RankPool(str(tmp_path / "pool"), world_size=2)
    try:
        out = p.run(_background_group_after_reinit, folder=str(tmp_path), timeout_s=60)
    finally:
        p.close()
    assert out == {r: {"same": False, "ranks": [0, 1], "sum": 2.0} for r in range(2)}


# -- DCP's HuggingFaceStorageWriter pieces ------------------------------------------------------

def rank_hf_storage_pieces(folder: str, consolidated: str) -> bool:
    """DCP's own HF writer, distributed, of the uneven state: without consolidation (a piece per rank
    per file, under the full names) and with it (full tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    model = _distribute(_full_state())["model"]
    sd = {k: v for k, v in model.items() if k not in ("f.weight", "plain")}  # (a 2-D mesh, and an int tensor
    # DCP's consolidation cannot size (torch.finfo of an int dtype), are not HuggingFaceStorageWriter's)
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(consolidated, save_distributed=True,
                                                         enable_consolidation=True))
    return True


def test_hf_storage_writer_pieces_are_refused_and_its_consolidated_folder_reads(pool, tmp_path):
    """A distributed HuggingFaceStorageWriter save without consolidation holds, in each rank's file,
    that rank's piece under the full tensor's name: fastckpt.load of one such file returned the piece
    as the tensor (a [2, 3] for a [4, 3]), exit 0, and the folder was refused as 'stored in both ...
    refusing to pick one'. Both are refused naming the piece and the ways to read it; the consolidated
    folder of the same writer reads whole, equal to the state."""
    from fastckpt.errors import ShardedCheckpointError
    pieces, whole = tmp_path / "pieces", tmp_path / "whole"
    pool.run(rank_hf_storage_pieces, folder=str(pieces), consolidated=str(whole), timeout_s=TIMEOUT_S)
    files = sorted(pieces.glob("*.safetensors"))
    assert len(files) == 2, os.listdir(pieces)
    for target in [pieces, *files]:
        with pytest.raises(ShardedCheckpointError) as ei:
            fastckpt.load(target)
        assert "one rank's piece" in str(ei.value) and "HuggingFaceStorageReader" in str(ei.value), str(ei.value)
    full = _full_state()["model"]
    got = fastckpt.load(whole)
    for k in ("a.weight", "b.weight", "c.weight", "d.weight", "e.bias"):
        assert got[k].dtype == full[k].dtype and torch.equal(got[k], full[k]), k
