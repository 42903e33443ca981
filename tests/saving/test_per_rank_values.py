"""Per-rank values in a multi-rank save are never taken from an arbitrary rank (issue 20, item 3).

2 spawned ranks (gloo, CPU). A state whose plain values differ between ranks (each rank's RNG state, a
per-rank step counter), next to an FSDP2 (``fully_shard``) model + AdamW or, for ``process_group=``
saves, a plain replicated model:

* without ``local_keys``: refused on every rank with ``RankValuesDifferError`` naming the keys and the
  ranks, before any file exists (it used to store rank 1's RNG state and rank 0's counter silently,
  and ``fastckpt verify`` said OK);
* with ``local_keys``: each rank's values are saved per rank and ``load_into`` gives each rank its own,
  bit-exactly (the RNG continues the same random stream); DTensor states used to refuse ``local_keys``;
* values equal on every rank (the optimizer's ``step`` tensors, a shared RNG state) stay stored once.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ranks import RankPool, full_values  # noqa: E402

import fastckpt  # noqa: E402

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("perrank")), world_size=2)
    yield p
    p.close()


# -- rank functions -------------------------------------------------------------------------------

def _model(fsdp: bool):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)  # the same batch on every rank: replicated values stay equal
    model(torch.randn(4, 8, generator=g)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _state(fsdp: bool, per_rank: bool) -> dict:
    import torch.distributed as dist
    model, optim = _model(fsdp)
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank if per_rank else 1000)  # each rank's own RNG stream
    torch.rand(3)
    return {"model": model.state_dict(), "optim": optim.state_dict(), "rng": torch.get_rng_state(),
            "counter": 50 + rank if per_rank else 50,  # a JSON value
            "seen": torch.tensor([400 + rank if per_rank else 400])}  # a tensor counter (samples this rank saw)



def _same(a, b, path="") -> list[str]:
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {set(a) ^ set(b)}"]
        return [p for k in a for p in _same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _same(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _zeroed(state: dict) -> dict:
    """The same structure with every tensor zeroed (DTensors: their local shard) and other counters."""
    def z(v):
        if isinstance(v, torch.Tensor):
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
        elif isinstance(v, dict):
            for x in v.values():
                z(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                z(x)
    z(state)
    state["counter"] = -1
    state["seen"] = torch.tensor([-1])
    return state


def rank_save(folder: str, route: str, per_rank: bool, local_keys: tuple) -> dict:
    """Save the state; return the outcome, then each rank's load_into result compared to its own values."""
    import torch.distributed as dist
    fsdp = route == "fsdp2"
    state = _state(fsdp, per_rank)
    want = full_values(state)
    path = os.path.join(folder, f"{route}-{per_rank}-{'-'.join(local_keys) or 'none'}")
    pg = None if fsdp else dist.group.WORLD
    try:
        fastckpt.save(state, path, process_group=pg, local_keys=local_keys, timeout_s=60)
    except Exception as e:
        dist.barrier()
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "keys": getattr(e, "keys", None), "exists": os.path.exists(path),
                "left": sorted(os.listdir(folder))}
    dist.barrier()
    tmpl = _zeroed(_state(fsdp, per_rank))
    out = fastckpt.load_into(tmpl, path)  # local_rank: this process's rank
    torch.set_rng_state(out["rng"])
    after = torch.rand(4)
    torch.set_rng_state(want["rng"])
    expect = torch.rand(4)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    return {"error": None, "diff": _same(want, full_values(out)), "counter": out["counter"], "seen": int(out["seen"]),
            "rng_continues": torch.equal(after, expect), "verify": bool(fastckpt.verify(path).ok),
            "files": sorted(os.listdir(path)), "tensor_keys": sorted(manifest["tensors"]),
            "rank_local": manifest["distributed"]["rank_local"]}


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["fsdp2", "process_group"])
def test_per_rank_values_are_refused_naming_keys_and_ranks(pool, tmp_path, route):
    out = pool.run(rank_save, folder=str(tmp_path), route=route, per_rank=True, local_keys=(), timeout_s=TIMEOUT_S)
    for r, res in out.items():
        assert res["error"] == "RankValuesDifferError", (r, res)
        assert "DistributedSaveError" in res["mro"] and "ValueError" in res["mro"]
        assert res["keys"] == {"counter": [[0], [1]], "rng": [[0], [1]], "seen": [[0], [1]]}, res["keys"]  # only those
        assert "'rng'" in res["message"] and "'counter'" in res["message"] and "[0] | [1]" in res["message"]
        assert "local_keys=" in res["message"]
        assert not res["exists"] and res["left"] == [], res  # refused before any file, temp folders included


@pytest.mark.parametrize("route", ["fsdp2", "process_group"])
def test_local_keys_save_per_rank_and_restore_each_ranks_values(pool, tmp_path, route):
    out = pool.run(rank_save, folder=str(tmp_path), route=route, per_rank=True, local_keys=("rng", "counter", "seen"),
                   timeout_s=TIMEOUT_S)
    for r, res in out.items():
        assert res["error"] is None, (r, res)
        assert res["diff"] == [], (r, res["diff"])  # model, optimizer, this rank's RNG state, all bit-exact
        assert res["counter"] == 50 + r and res["seen"] == 400 + r
        assert res["rng_continues"]
        assert res["verify"]
        assert {"state-rank00000.json", "state-rank00001.json", "rank00000-00001-of-00001.safetensors",
                "rank00001-00001-of-00001.safetensors"} <= set(res["files"]), res["files"]
        assert res["rank_local"] == {"keys": ["rng", "counter", "seen"], "skeletons": {"0": "state-rank00000.json",
                                                                               "1": "state-rank00001.json"}}
        assert {"@rank0/local/rng", "@rank1/local/rng"} <= set(res["tensor_keys"])
        assert "rng" not in res["tensor_keys"]


@pytest.mark.parametrize("route", ["fsdp2", "process_group"])
def test_values_equal_on_every_rank_are_stored_once(pool, tmp_path, route):
    out = pool.run(rank_save, folder=str(tmp_path), route=route, per_rank=False, local_keys=(), timeout_s=TIMEOUT_S)
    for r, res in out.items():
        assert res["error"] is None, (r, res)
        assert res["diff"] == [] and res["counter"] == 50 and res["seen"] == 400 and res["rng_continues"] and res["verify"]
        assert not any(k.startswith("@rank") for k in res["tensor_keys"])
        assert "rng" in res["tensor_keys"] and not any(f.startswith(("rank0", "state-rank")) for f in res["files"])
        assert res["rank_local"]["skeletons"] == {}


def rank_dtensor_under_local_keys(folder: str) -> dict:
    state = _state(True, True)
    path = os.path.join(folder, "dt-local")
    try:
        fastckpt.save(state, path, local_keys=("model", "rng"), timeout_s=60)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "exists": os.path.exists(path),
                "left": sorted(os.listdir(folder))}
    return {"error": None}


def test_dtensor_under_local_keys_is_refused(pool, tmp_path):
    out = pool.run(rank_dtensor_under_local_keys, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, res in out.items():
        assert res["error"] == "UnsupportedValueError" and "model/" in res["message"], (r, res)
        assert not res["exists"] and res["left"] == []


class _AppState:
    """The PyTorch DCP tutorial's AppState (Stateful): model + optimizer through get/set_state_dict."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def rank_fsdp2_app_state(folder: str) -> dict:
    """Save {"app": AppState} with fastckpt and with dcp.save(FileSystemWriter); load each into a fresh
    AppState (fastckpt.load_into / dcp.load); return the full values after each load."""
    import torch.distributed.checkpoint as dcp
    model, optim = _model(True)
    app = _AppState(model, optim)
    want = full_values(app.state_dict())
    fastckpt.save({"app": app, "epoch": 2}, os.path.join(folder, "fck"), timeout_s=60)
    dcp.save({"app": app, "epoch": 2}, storage_writer=dcp.FileSystemWriter(os.path.join(folder, "dcp")))
    got = {}
    for via in ("fck", "dcp"):
        m2, o2 = _model(True)
        for p in m2.parameters():  # other values, same structure
            p.detach().to_local().fill_(0.5)
        app2 = _AppState(m2, o2)
        state = {"app": app2, "epoch": 0}
        if via == "fck":
            out = fastckpt.load_into(state, os.path.join(folder, "fck"))
        else:
            dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(folder, "dcp")))
            out = state
        assert out["app"] is app2
        got[via] = {"values": full_values(app2.state_dict()), "epoch": out["epoch"]}
    return {"fck": _same(want, got["fck"]["values"]), "dcp": _same(want, got["dcp"]["values"]),
            "between": _same(got["dcp"]["values"], got["fck"]["values"]),
            "epochs": (got["fck"]["epoch"], got["dcp"]["epoch"])}


def test_fsdp2_app_state_saves_and_loads_as_dcp_does(pool, tmp_path):
    out = pool.run(rank_fsdp2_app_state, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, res in out.items():
        assert res == {"fck": [], "dcp": [], "between": [], "epochs": (2, 2)}, (r, res)


def test_digests_name_each_differing_leaf_and_group_the_ranks():
    from fastckpt.format.tree import flatten
    from fastckpt.saving.agree import array_digest, differing, json_leaves, refusal

    def digests(rank: int) -> dict:
        state = {"a": {"lr": 0.1, "nan": float("nan"), "t": (1, "x"), "empty": {}},
                 "__odd": {3: rank % 2}, "w": torch.ones(2), "g": torch.full((2,), float(rank >= 2))}
        arrays = {}
        out = json_leaves(flatten(state, lambda k, v: arrays.__setitem__(k, v)))
        out.update((k, array_digest(v)) for k, v in arrays.items())
        return out
    per_rank = [digests(r) for r in range(4)]
    assert set(per_rank[0]) == {"a/lr", "a/nan", "a/t/0", "a/t/1", "a/empty", "__odd/3", "w", "g"}
    diff = differing(per_rank)
    assert diff == {"__odd/3": [[0, 2], [1, 3]], "g": [[0, 1], [2, 3]]}
    e = refusal("/ck", diff)
    assert e.keys == diff and e.failures.keys() == {1, 2, 3}
    assert "'g': ranks [0, 1] | [2, 3]" in str(e) and "local_keys=('__odd', 'g')" in str(e)
