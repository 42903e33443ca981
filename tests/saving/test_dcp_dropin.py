"""``FastCkptWriter`` / ``FastCkptReader`` as drop-ins for DCP's own storage (issue 20, item 4).

Code that already calls DCP switches only its storage: ``dcp.save(state, storage_writer=FastCkptWriter(p))``
with DCP's default planner (no ``planner=``), with a planner that subclasses ``DefaultSavePlanner`` (as
torchtitan and transformers do), and ``dcp.async_save``; ``dcp.load(state, storage_reader=FastCkptReader(p))``
with ``DefaultLoadPlanner`` or a subclass. The reference is DCP itself: the same state is saved with DCP's
``FileSystemWriter`` and read with its ``FileSystemReader`` in the same test, and the values loaded back
must be equal both ways. Nothing is unpickled on any load (``pickle.loads`` / ``torch.load`` raise while
loading). One process in pytest; FSDP2 (``fully_shard``) in 2 spawned gloo ranks with bounded waits.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

sys.path.insert(0, os.path.dirname(__file__))
from ranks import RankPool, full_values  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.dcp import FastCkptLoadPlanner, FastCkptReader, FastCkptSavePlanner, FastCkptWriter  # noqa: E402

TIMEOUT_S = 240


class SubSavePlanner(DefaultSavePlanner):
    """A DefaultSavePlanner subclass overriding something trivial, as torchtitan / transformers subclass it."""

    def create_local_plan(self):
        self.calls = getattr(self, "calls", 0) + 1
        return super().create_local_plan()


class SubLoadPlanner(DefaultLoadPlanner):
    """A DefaultLoadPlanner subclass overriding something trivial."""

    def transform_tensor(self, read_item, tensor):
        return super().transform_tensor(read_item, tensor)


class BytesOverridePlanner(DefaultLoadPlanner):
    """Overrides load_bytes: it expects pickled bytes, which fastckpt never hands out."""

    def load_bytes(self, read_item, value):
        raise AssertionError("load_bytes must not be reached")


class _NoPickle:
    """``pickle.loads`` and ``torch.load`` raise while active."""

    def __enter__(self):
        self.saved = pickle.loads, torch.load

        def refuse(*a, **k):
            raise AssertionError("unpickling during a fastckpt DCP load")

        pickle.loads = torch.load = refuse
        return self

    def __exit__(self, *exc):
        pickle.loads, torch.load = self.saved


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step,
            "extra": {"note": ("run", 1.5, None), "tags": ["a", "b"], "dtype": torch.bfloat16}}


def _trained(seed: int):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    m(torch.randn(4, 6)).sum().backward()
    opt.step()
    return m, opt


def _fresh(seed: int = 9) -> dict:
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    m(torch.randn(4, 6)).sum().backward()
    opt.step()  # optimizer state present, values differ from the checkpoint's
    s = _state(m, opt, 0)
    s["extra"] = {"note": None, "tags": [], "dtype": None}
    return s


def _same(got, want, path: str = "") -> list[str]:
    """Key paths where two nested states differ (tensors: dtype, shape and every bit; DTensors gathered)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(map(str, got)) != set(map(str, want)):
            have = sorted(map(str, got)) if isinstance(got, dict) else repr(got)
            return [f"{path}: keys {have} != {sorted(map(str, want))}"]
        g = {str(k): v for k, v in got.items()}
        return [m for k, v in want.items() for m in _same(g[str(k)], v, f"{path}/{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path}: {got!r} != {want!r}"]
        return [m for i, (a, b) in enumerate(zip(got, want)) for m in _same(a, b, f"{path}/{i}")]
    if isinstance(want, torch.Tensor):  # bitwise (uint8 views)
        if hasattr(got, "full_tensor"):
            got = got.full_tensor()
        if hasattr(want, "full_tensor"):
            want = want.full_tensor()
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and \
            torch.equal(got.detach().reshape(-1).view(torch.uint8), want.detach().reshape(-1).view(torch.uint8))
        return [] if ok else [path]
    return [] if got == want and type(got) is type(want) else [f"{path}: {got!r} != {want!r}"]


def _save(state: dict, path, how: str) -> None:
    if how == "default":
        dcp.save(state, storage_writer=FastCkptWriter(path))
    elif how == "subclass":
        planner = SubSavePlanner()
        dcp.save(state, storage_writer=FastCkptWriter(path), planner=planner)
        assert planner.calls == 1
    elif how == "async":
        dcp.async_save(state, storage_writer=FastCkptWriter(path)).result(timeout=TIMEOUT_S)
    elif how == "reference":
        dcp.save(state, storage_writer=FileSystemWriter(str(path)))
    else:
        raise ValueError(how)


def _check_folder(path: Path, state: dict) -> None:
    """A valid fastckpt checkpoint: manifest, HF-layout safetensors the ``safetensors`` package reads
    bit-exactly, ``fastckpt verify`` OK, ``fastckpt.load`` gives the state back; never DCP's pickle."""
    from safetensors.torch import load_file
    names = sorted(os.listdir(path))
    assert "manifest.json" in names and ".metadata" not in names and not any(n.endswith(".distcp") for n in names)
    index = path / "model.safetensors.index.json"  # past one shard; one shard: model.safetensors (HF naming)
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    got = {}
    for f in sorted(files):
        got.update(load_file(str(path / f)))
    assert _same(got, {k: v for k, v in state["model"].items()}) == []
    report = fastckpt.verify(path)
    assert report.ok, report.problems
    from fastckpt.cli.main import main as cli_main
    assert cli_main(["verify", str(path)]) == 0
    assert _same(fastckpt.load(path), state) == []


def _metadata_matches_reference(ours, ref) -> None:
    """The reader's DCP metadata names what DCP's own metadata names, with the same kinds, sizes, dtypes."""
    assert set(ours.state_dict_metadata) == set(ref.state_dict_metadata)
    for fqn, r in ref.state_dict_metadata.items():
        o = ours.state_dict_metadata[fqn]
        assert type(o) is type(r), fqn
        if isinstance(r, TensorStorageMetadata):
            assert (o.size, o.properties.dtype) == (r.size, r.properties.dtype), fqn
        else:
            assert isinstance(r, BytesStorageMetadata)
    assert ours.planner_data == ref.planner_data


# -- one process ------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["default", "subclass", "async"])
def test_dcp_save_and_load_with_dcp_planners_one_process(tmp_path, how):
    m, opt = _trained(0)
    state = _state(m, opt, 7)
    _save(state, tmp_path / "ours", how)
    _save(state, tmp_path / "ref", "reference")
    _check_folder(tmp_path / "ours", state)
    # the same folder FastCkptSavePlanner writes for this state
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "fast"), planner=FastCkptSavePlanner())
    a, b = fastckpt.read_manifest(tmp_path / "ours"), fastckpt.read_manifest(tmp_path / "fast")
    fields = ("file", "name", "dtype", "shape", "offsets", "xxh3")
    assert {k: [getattr(e, f) for f in fields] for k, e in a.tensors.items()} == \
        {k: [getattr(e, f) for f in fields] for k, e in b.tensors.items()}
    assert (tmp_path / "ours" / "state.json").read_bytes() == (tmp_path / "fast" / "state.json").read_bytes()
    assert "dcp_metadata.json" in a.files
    _metadata_matches_reference(FastCkptReader(tmp_path / "ours").read_metadata(),
                                FileSystemReader(str(tmp_path / "ref")).read_metadata())
    # load back with DCP's planners; DCP's own storage is the reference
    for planner in (None, SubLoadPlanner()):
        ours, ref = _fresh(), _fresh()
        kw = {} if planner is None else {"planner": planner}
        with _NoPickle():
            dcp.load(ours, storage_reader=FastCkptReader(tmp_path / "ours"), **kw)
        dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")),
                 **({} if planner is None else {"planner": SubLoadPlanner()}))
        assert _same(ours, ref) == []
        assert _same(ours, state) == []


def test_fastckpt_planner_folder_loads_with_dcp_default_planner(tmp_path):
    m, opt = _trained(1)
    state = _state(m, opt, 3)
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ck"), planner=FastCkptSavePlanner())
    fastckpt.save(state, tmp_path / "plain")
    for ck in ("ck", "plain"):
        got = _fresh()
        with _NoPickle():
            dcp.load(got, storage_reader=FastCkptReader(tmp_path / ck))
        assert _same(got, state) == [], ck


def test_tuples_holding_tensors_load_as_dcp_loads_them(tmp_path):
    """DCP's flattening stops at a tuple and pickles it whole (an RNG state, ``(scale, tensor)``); read
    through FastCkptReader (both planners; folders of FastCkptWriter with FastCkptSavePlanner, which stores
    the tensors inside as tensors, and of fastckpt.save) the same
    values come back as from DCP's own FileSystemReader, tensors and numpy arrays included, and nothing
    is unpickled (the tensors inside used to come back as empty meta tensors)."""
    import numpy as np
    from fastckpt.dcp import FastCkptLoadPlanner
    rng = np.random.RandomState(3)
    state = {"t": (1.5, torch.arange(4.0)), "rng": rng.get_state(), "l": [2, torch.ones(3)],
             "n": {"x": (torch.arange(3), {"y": torch.full((2,), 7.0, dtype=torch.bfloat16)})}}

    def template():
        return {"t": (0.0, torch.zeros(4)), "rng": None, "l": [0, torch.zeros(3)], "n": {"x": None}}

    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ref")))
    ref = template()
    dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")))
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ours"), planner=FastCkptSavePlanner())
    fastckpt.save(state, tmp_path / "plain")
    for folder in ("ours", "plain"):
        for planner in (None, FastCkptLoadPlanner()):
            got = template()
            with _NoPickle():
                dcp.load(got, storage_reader=FastCkptReader(tmp_path / folder),
                         **({} if planner is None else {"planner": planner}))
            where = (folder, type(planner).__name__)
            assert _same({k: v for k, v in got.items() if k != "rng"}, {k: v for k, v in ref.items() if k != "rng"}) == [], where
            assert type(got["rng"]) is tuple and got["rng"][0] == ref["rng"][0] == "MT19937", where
            assert isinstance(got["rng"][1], np.ndarray) and np.array_equal(got["rng"][1], ref["rng"][1]), where
            assert got["rng"][2:] == ref["rng"][2:], where


def test_default_planner_tuple_holding_a_tensor_is_refused_naming_the_planner_that_stores_it(tmp_path):
    """DCP's default planner hands a tuple holding a tensor over whole (it would pickle it): the writer
    refuses it, nothing committed, and the message names FastCkptSavePlanner, which stores it (it said
    only 'convert it to such values or to a tensor')."""
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"t": (1.5, torch.arange(4.0)), "w": torch.ones(2)}, storage_writer=FastCkptWriter(tmp_path / "ck"))
    msg = str(ei.value)
    assert "UnsupportedValueError" in msg and "'t'" in msg and "planner=fastckpt.dcp.FastCkptSavePlanner()" in msg, msg
    assert os.listdir(tmp_path) == []  # nothing committed, nothing left behind
    dcp.save({"t": (1.5, torch.arange(4.0)), "w": torch.ones(2)}, storage_writer=FastCkptWriter(tmp_path / "ck"),
             planner=FastCkptSavePlanner())
    assert torch.equal(fastckpt.load(tmp_path / "ck")["t"][1], torch.arange(4.0))


@pytest.mark.parametrize("in_list", [False, True])
def test_default_planner_folder_of_int_keyed_optimizer_state_fills_with_load_into(tmp_path, in_list):
    """DCP's default planner names mapping keys as str (``optim.state.0.step`` -> key ``"0"``), so
    the folder holds ``optim/state/"0"/...`` where ``opt.state_dict()`` has ``state/0``. DCP's own load
    fills the int-keyed state from either; ``fastckpt.load_into`` does too, with the bytes DCP's
    ``FileSystemReader`` gives (it refused: 'missing from the checkpoint: optim/state/0/step').
    ``in_list``: the optimizer's state under a list (``{"optim": [sd]}``): a list position stays a
    position (it was flipped to a str key too, and the state refused as missing)."""
    wrap = (lambda sd: [sd]) if in_list else (lambda sd: sd)
    unwrap = (lambda v: v[0]) if in_list else (lambda v: v)
    m, opt = _trained(2)
    saved = {"optim": wrap(opt.state_dict()), "step": 4}
    dcp.save(saved, storage_writer=FastCkptWriter(tmp_path / "ours"))
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "ref")))
    stored = unwrap(fastckpt.load(tmp_path / "ours")["optim"])["state"]
    assert sorted(stored) == ["0", "1", "2", "3"]  # what DCP's planner handed the writer
    ref = {"optim": wrap(_trained(5)[1].state_dict()), "step": 0}
    dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")))
    got = fastckpt.load_into({"optim": wrap(_trained(5)[1].state_dict()), "step": 0}, tmp_path / "ours", strict=True)
    assert sorted(unwrap(got["optim"])["state"]) == [0, 1, 2, 3]
    assert _same(got, ref) == [] and _same(got, saved) == []


class Opaque:
    def __init__(self):
        self.x = 1


def test_unpicklable_value_is_refused_naming_the_key(tmp_path):
    m, opt = _trained(2)
    state = {"model": m.state_dict(), "helper": Opaque()}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ck"))
    msg = str(ei.value)
    assert "UnsupportedValueError" in msg and "'helper'" in msg and "Opaque" in msg and "pickle" in msg, msg
    assert os.listdir(tmp_path) == []  # nothing committed, nothing left behind


def test_load_bytes_override_is_refused_before_any_read(tmp_path):
    m, opt = _trained(3)
    state = _state(m, opt, 5)
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ck"))
    got = _fresh()
    before = got["model"]["0.weight"].clone()
    with pytest.raises(CheckpointException) as ei:
        dcp.load(got, storage_reader=FastCkptReader(tmp_path / "ck"), planner=BytesOverridePlanner())
    assert "DCPPlannerError" in str(ei.value) and "load_bytes" in str(ei.value)
    assert torch.equal(got["model"]["0.weight"], before)


# -- 2 ranks, FSDP2 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(str(tmp_path_factory.mktemp("dropin-pool")), world_size=2)
    yield p
    p.close()


def _fsdp(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))  # 7 rows: 4 / 3
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    m(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt



def rank_fsdp_dropin(folder: str) -> dict:
    import torch.distributed as dist
    m, opt = _fsdp(0)
    state = _state(m, opt, 11)
    out: dict = {}
    for how in ("default", "subclass", "async", "reference"):
        _save(state, os.path.join(folder, how), how)
    dist.barrier()
    for how in ("default", "subclass", "async"):
        for lp in ("default", "subclass"):
            fm, fo = _fsdp(5)
            ours, ref = _state(fm, fo, 0), _state(*_fsdp(6), 0)
            kw = (lambda: {}) if lp == "default" else (lambda: {"planner": SubLoadPlanner()})
            with _NoPickle():
                dcp.load(ours, storage_reader=FastCkptReader(os.path.join(folder, how)), **kw())
            dcp.load(ref, storage_reader=FileSystemReader(os.path.join(folder, "reference")), **kw())
            out[f"{how}/{lp}"] = {"vs_ref": _same(ours, ref), "vs_saved": _same(ours, state)}
    full = full_values(state)
    dist.barrier()
    out["full"] = full if dist.get_rank() == 0 else None
    return out


def test_fsdp2_two_ranks_dcp_planners(pool, tmp_path):
    res = pool.run(rank_fsdp_dropin, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r, out in res.items():
        for k, v in out.items():
            if k != "full":
                assert v == {"vs_ref": [], "vs_saved": []}, (r, k, v)
    full = res[0]["full"]
    for how in ("default", "subclass", "async"):
        path = tmp_path / how
        _check_folder(path, full)
        m = fastckpt.read_manifest(path)
        assert [c.shape for c in m.tensors["model/0.weight"].chunks] == [(4, 6), (3, 6)]  # each rank's shard
    _metadata_matches_reference(FastCkptReader(tmp_path / "default").read_metadata(),
                                FileSystemReader(str(tmp_path / "reference")).read_metadata())


class FP16SavePlanner(DefaultSavePlanner):
    """DCP's own docs' example of a subclass that changes what is written: every tensor as float16."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        for p in plan.items:
            if p.tensor_data is not None:
                p.tensor_data.properties.dtype = torch.float16
        return plan

    def resolve_data(self, write_item):
        from torch.distributed.checkpoint.planner import WriteItemType
        item = super().resolve_data(write_item)
        return item if write_item.type == WriteItemType.BYTE_IO else item.to(torch.float16)


def test_subclass_that_changes_dtypes_writes_what_dcp_writes(tmp_path):
    m, opt = _trained(4)
    state = _state(m, opt, 2)
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ours"), planner=FP16SavePlanner())
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ref")), planner=FP16SavePlanner())
    back = fastckpt.load(tmp_path / "ours")
    assert back["model"]["0.weight"].dtype == torch.float16
    half = {k: v.to(torch.float16) for k, v in state["model"].items()}
    assert _same(back["model"], half) == []
    _metadata_matches_reference(FastCkptReader(tmp_path / "ours").read_metadata(),
                                FileSystemReader(str(tmp_path / "ref")).read_metadata())
    ours, ref = _fresh(), _fresh()  # fp32 templates: fp16 stored values cast back, as DCP's reader does
    with _NoPickle():
        dcp.load(ours, storage_reader=FastCkptReader(tmp_path / "ours"))
    dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")))
    assert _same(ours, ref) == []
    assert _same(ours["model"], {k: v.to(torch.float32) for k, v in half.items()}) == []


class ExtraDataSavePlanner(DefaultSavePlanner):
    """DCP's own docs' example of a subclass that puts its own data in ``planner_data`` (DCP's own
    global plan needs ``flatten_state_dict=False`` then: it merges ``planner_data`` as fqn mappings)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def create_local_plan(self):
        from dataclasses import replace
        return replace(super().create_local_plan(), planner_data="per-rank-data")

    def create_global_plan(self, all_plans):
        from dataclasses import replace
        global_plan, metadata = super().create_global_plan(all_plans)
        return global_plan, replace(metadata, planner_data=[p.planner_data for p in global_plan])


def test_subclass_with_its_own_planner_data(tmp_path):
    m, _ = _trained(5)
    state = {**{k: v for k, v in m.state_dict().items()}, "step": 8, "note": ("a", 2)}
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ours"), planner=ExtraDataSavePlanner())
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ref")), planner=ExtraDataSavePlanner())
    assert _same(fastckpt.load(tmp_path / "ours"), state) == []
    assert fastckpt.verify(tmp_path / "ours").ok
    fresh = lambda: {**{k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)},  # noqa: E731
                     "step": 0, "note": None}
    ours, ref = fresh(), fresh()
    with _NoPickle():
        dcp.load(ours, storage_reader=FastCkptReader(tmp_path / "ours"))
    dcp.load(ref, storage_reader=FileSystemReader(str(tmp_path / "ref")))
    assert _same(ours, ref) == [] and _same(ours, state) == []


def rank_dropin_from_memory(folder: str) -> dict:
    """dcp.save / dcp.async_save through FastCkptWriter(o_direct=False) of 2-rank DTensors whose runs are
    large: DCP's write_data gets tensors that stay unchanged until it returns, so the chunks are written
    from their memory (no staging buffer acquired); counts the acquisitions of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastckpt.storage.staging import StagingPool
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    full = {"model": {"a.weight": torch.randn(4099, 33, generator=g), "b.weight": torch.randn(1024, 256, generator=g)}}
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()}}
    acquired = []
    orig = StagingPool.acquire

    def counting(self, *a, **kw):
        acquired.append(1)
        return orig(self, *a, **kw)
    StagingPool.acquire = counting
    out = {}
    try:
        dcp.save(state, storage_writer=FastCkptWriter(os.path.join(folder, "sync"), o_direct=False))
        out["sync"] = len(acquired)
        dcp.async_save(state, storage_writer=FastCkptWriter(os.path.join(folder, "async"), o_direct=False)).result(
            timeout=TIMEOUT_S)
        out["async"] = len(acquired) - out["sync"]
    finally:
        StagingPool.acquire = orig
    back = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full["model"].items()}}
    dcp.load(back, storage_reader=FastCkptReader(os.path.join(folder, "sync")))
    out["bad"] = [k for k, v in full["model"].items() if not torch.equal(back["model"][k].full_tensor(), v)]
    return out


def test_dropin_writes_large_chunks_from_their_memory(pool, tmp_path):
    res = pool.run(rank_dropin_from_memory, folder=str(tmp_path), timeout_s=TIMEOUT_S)
    for r in (0, 1):
        assert res[r]["bad"] == [], res[r]
        assert res[r]["sync"] == 0 and res[r]["async"] == 0, res[r]  # async: the stager copied already
    g = torch.Generator().manual_seed(3)
    full = {"model": {"a.weight": torch.randn(4099, 33, generator=g), "b.weight": torch.randn(1024, 256, generator=g)}}
    for how in ("sync", "async"):
        back = fastckpt.load(tmp_path / how)  # checksums checked
        for k, v in full["model"].items():
            assert torch.equal(back["model"][k], v), (how, k)


def test_numpy_array_round_trips_through_the_fastckpt_planners(tmp_path):
    """A NumPy array in a DCP state: the default planner would pickle it (refused, naming it as an
    ndarray: the message called it a tuple); FastCkptSavePlanner stores it as a tensor, and
    dcp.load with FastCkptReader + FastCkptLoadPlanner fills the caller's array in place (it failed
    with DCP's 'expected BytesStorageMetadata'), as FileSystemWriter/Reader round-trip it."""
    import numpy as np
    state = {"arr": np.arange(4, dtype=np.int64), "w": torch.ones(2), "step": 3}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "default"))
    assert "'arr' is a ndarray" in str(ei.value) and "FastCkptLoadPlanner" in str(ei.value), str(ei.value)
    dcp.save(state, storage_writer=FastCkptWriter(tmp_path / "ck"), planner=FastCkptSavePlanner())
    tmpl = {"arr": np.zeros(4, dtype=np.int64), "w": torch.zeros(2), "step": 0}
    arr = tmpl["arr"]
    dcp.load(tmpl, storage_reader=FastCkptReader(tmp_path / "ck"), planner=FastCkptLoadPlanner())
    assert tmpl["arr"] is arr and arr.tolist() == [0, 1, 2, 3]  # the caller's array, filled
    assert tmpl["step"] == 3 and torch.equal(tmpl["w"], torch.ones(2))
    tmpl2 = {"arr": np.zeros(4, dtype=np.int64), "w": torch.zeros(2), "step": 0}
    fastckpt.dcp.load(tmpl2, tmp_path / "ck")
    assert tmpl2["arr"].tolist() == [0, 1, 2, 3] and tmpl2["step"] == 3


_PROCESS_ASYNC = """
import sys, datetime, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from fastckpt.dcp import FastCkptReader, FastCkptWriter
d = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
S = {"w": torch.arange(6.0), "n": 3}
dcp.async_save(S, storage_writer=FastCkptWriter(f"{d}/ck"),
               async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=120)
T = {"w": torch.zeros(6), "n": 0}
dcp.load(T, storage_reader=FastCkptReader(f"{d}/ck"))
print("LOADED", torch.equal(T["w"], S["w"]), T["n"])
dist.destroy_process_group()
"""


def test_async_save_in_dcps_checkpoint_process(tmp_path):
    """dcp.async_save(async_checkpointer_type=PROCESS) pickles the writer to its checkpoint process:
    FastCkptWriter failed with 'cannot pickle _thread.lock' (its staging pool), where FileSystemWriter
    works; it now goes without its pool and the child stages into its own."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _PROCESS_ASYNC, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "LOADED True 3" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    assert fastckpt.is_committed(tmp_path / "ck")
