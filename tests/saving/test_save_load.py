"""save / async_save / load: the public API of issue 2, compared on raw bytes."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import random
import threading
import time

import numpy as np
import subprocess
import sys
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fastckpt
from fastckpt.errors import (CheckpointExistsError, CheckpointNotFoundError, ChecksumMismatchError,
                             CorruptCheckpointError, UnsupportedValueError)
from fastckpt.storage.io import PosixBackend

from fastckpt_testkit import FaultyBackend, assert_same, assert_tree_same, listing, no_temps, raw


def manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def small_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"embed.weight": torch.randn(16, 8, generator=g), "norm.bias": torch.randn(8, generator=g)},
            "step": seed}


# ---------------------------------------------------------------- round trips + safetensors interop

def test_roundtrip_and_safetensors_reads_our_shards(tmp_path):
    state = {"model": {"a.weight": torch.randn(32, 16).to(torch.bfloat16), "b": torch.arange(10),
                       "flag": torch.tensor([True, False])},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(5)}}}, "step": 7}
    p = fastckpt.save(state, tmp_path / "ck")
    assert p == tmp_path / "ck" and no_temps(tmp_path) and fastckpt.is_committed(p)
    assert_tree_same(state, fastckpt.load(p))
    m = manifest(p)
    for key, e in m["tensors"].items():
        if "file" not in e:
            continue
        got = load_file(str(p / e["file"]))[e["name"]]
        with safe_open(str(p / e["file"]), "pt") as f:
            assert_same(f.get_tensor(e["name"]), got, key)
        ref = {"model/a.weight": state["model"]["a.weight"], "model/b": state["model"]["b"],
               "model/flag": state["model"]["flag"],
               "optimizer/state/0/exp_avg": state["optimizer"]["state"][0]["exp_avg"]}[key]
        assert_same(ref, got, key)
    # model tensors keep their raw names in HF-named shards
    assert load_file(str(p / "model.safetensors")).keys() == {"a.weight", "b", "flag"}
    assert fastckpt.verify(p).ok


def test_overwrite_refused_then_atomic_replace(tmp_path):
    p = tmp_path / "ck"
    fastckpt.save(small_state(1), p)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        fastckpt.save(small_state(2), p)
    assert_tree_same(small_state(1), fastckpt.load(p))
    fastckpt.save(small_state(2), p, overwrite=True)
    assert_tree_same(small_state(2), fastckpt.load(p))
    assert listing(tmp_path) == ["ck"]


def test_async_save_holds_values_at_call_time(tmp_path):
    for opts in ({}, {"staging_bytes": 1 << 20, "chunk_bytes": 1 << 16}):
        w = torch.randn(300, 1000)
        before = w.clone()
        d = tmp_path / f"ck{len(opts)}"
        fut = fastckpt.async_save({"w": w, "v": w[::2]}, d, **opts)
        w.add_(1.0)  # mutate in place right after the call returns
        w[0, 0] = float("nan")
        assert fut.result() == d and fut.done()
        out = fastckpt.load(d)
        assert_same(before, out["w"])
        assert_same(before[::2], out["v"])


def test_result_reraises_same_exception_every_call(tmp_path):
    be = FaultyBackend(fail_pwrite_after=0, err=errno.EIO)
    fut = fastckpt.async_save(small_state(), tmp_path / "ck", io_backend=be)
    errs = []
    for _ in range(3):
        with pytest.raises(OSError) as ei:
            fut.result()
        errs.append(ei.value)
    assert errs[0] is errs[1] is errs[2] and errs[0] in be.raised
    assert errs[0].errno == errno.EIO
    assert fut.exception() is errs[0]
    assert listing(tmp_path) == []


def test_uncollected_failure_is_raised_by_next_save(tmp_path):
    be = FaultyBackend(fail_pwrite_after=0, err=errno.ENOSPC)
    fut = fastckpt.async_save(small_state(), tmp_path / "bad", io_backend=be)
    while not fut.done():
        time.sleep(0.01)
    with pytest.raises(OSError) as ei:
        fastckpt.save(small_state(), tmp_path / "good")
    # the background failure itself (typed as the full device it is, naming the file; the injected error its cause)
    assert ei.value.__cause__ is be.raised[0] and ei.value.errno == errno.ENOSPC and ei.value.filename
    assert listing(tmp_path) == []  # the next save did not start
    fastckpt.save(small_state(), tmp_path / "good")  # reported once, then the saver is usable
    assert listing(tmp_path) == ["good"]


class SlowBackend(PosixBackend):
    def __init__(self, delay_s):
        self.delay_s = delay_s

    def fsync(self, fd):
        time.sleep(self.delay_s)
        super().fsync(fd)


def test_second_async_save_waits_for_first(tmp_path):
    f1 = fastckpt.async_save(small_state(1), tmp_path / "a", io_backend=SlowBackend(0.4))
    assert not f1.done()
    f2 = fastckpt.async_save(small_state(2), tmp_path / "b")
    assert f1.done()  # the second call returned only after the first finished
    f2.result()
    f1.result()
    assert_tree_same(small_state(1), fastckpt.load(tmp_path / "a"))


# ---------------------------------------------------------------- values and key types

def test_optimizer_int_keys_and_moments_restored(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    fastckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck")
    assert sorted(out["optimizer"]["state"]) == [0, 1, 2, 3]
    assert all(type(k) is int for k in out["optimizer"]["state"])
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model2.load_state_dict(out["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    opt2.load_state_dict(out["optimizer"])
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 1e-2
    for i in range(4):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert_same(s1["state"][i][k], s2["state"][i][k], f"{i}/{k}")


def test_python_numpy_torch_rng_states_roundtrip(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
             "vals": (math.nan, math.inf, -math.inf, np.float64(0.5), np.int32(7)), "dt": torch.float16,
             "nested": [(1, 2), {"x": (None,)}], "arr": np.arange(6, dtype=np.float32).reshape(2, 3)}
    fastckpt.save(state, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck")
    assert out["py"] == state["py"] and isinstance(out["py"], tuple)
    assert isinstance(out["np"], tuple) and out["np"][0] == "MT19937"
    assert out["dt"] is torch.float16
    assert math.isnan(out["vals"][0]) and out["vals"][1:3] == (math.inf, -math.inf)
    assert type(out["vals"][3]) is np.float64 and type(out["vals"][4]) is np.int32
    assert out["nested"] == [(1, 2), {"x": (None,)}]
    assert isinstance(out["arr"], np.ndarray) and out["arr"].dtype == np.float32
    assert out["arr"].tobytes() == state["arr"].tobytes()
    expect = (random.random(), np.random.rand(), torch.rand(2))
    random.setstate(out["py"])
    np.random.set_state(out["np"])
    torch.set_rng_state(out["torch"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[:2] == expect[:2] and raw(got[2]) == raw(expect[2])


@pytest.mark.parametrize("bad, where", [({"model": {"w": torch.ones(1), "opt": object()}}, "model/opt"),
                                        ({"x": [torch.ones(1), {"c": torch.ones(2, dtype=torch.complex128)}]},
                                         "x/1/c")])
def test_unsupported_value_refused_before_any_file(tmp_path, bad, where):
    with pytest.raises(UnsupportedValueError, match=where):
        fastckpt.save(bad, tmp_path / "sub" / "ck")
    assert listing(tmp_path) == []


def test_unambiguous_key_paths(tmp_path):
    state = {"a.b": torch.tensor([1]), "a": {"b": torch.tensor([2])}, 0: torch.tensor([3]), "0": torch.tensor([4]),
             "x/y": torch.tensor([5]), "x": {"y": torch.tensor([6])}}
    fastckpt.save(state, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck")
    assert_tree_same(state, out)
    assert len(manifest(tmp_path / "ck")["tensors"]) == 6


def test_shared_storage_comes_back_shared(tmp_path):
    w = torch.randn(6, 4)
    emb = torch.randn(10, 3)
    state = {"model": {"embed": emb, "lm_head": emb}, "w": w, "row": w[2], "wt": w.t(), "cols": w[:, 1:3],
             "flat": w.view(-1)[5:17]}
    fastckpt.save(state, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck")
    assert_tree_same(state, out)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert out["model"]["embed"].data_ptr() == out["model"]["lm_head"].data_ptr()
    assert len({ptr(out[k]) for k in ("w", "row", "wt", "cols", "flat")}) == 1
    assert out["wt"].stride() == w.t().stride() and out["cols"].stride() == w[:, 1:3].stride()
    out["w"][2, 0] = 123.0  # a write through one view shows in the others, as before saving
    assert out["row"][0] == 123.0 and out["wt"][0, 2] == 123.0
    # tied weights are stored once
    m = manifest(tmp_path / "ck")
    assert sum(1 for e in m["tensors"].values() if "file" in e) == 2


def test_non_contiguous_tensors(tmp_path):
    base = torch.arange(48, dtype=torch.int16).reshape(6, 8)
    state = {"t": base.t()[1:], "s": base[:, ::3], "e": torch.tensor([1.5]).expand(4, 3),
             "perm": torch.randn(2, 3, 4).permute(2, 0, 1)}
    # separate storages except t and s; keep it interesting: save only strided views of one base
    fastckpt.save(state, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck")
    for k, v in state.items():
        assert_same(v, out[k], k)


def test_keys_selection_by_path_and_prefix(tmp_path):
    state = {"model": {"w": torch.ones(2), "b": torch.zeros(2)},
             "optimizer": {"state": {0: {"m": torch.full((3,), 2.0)}}, "param_groups": [{"lr": 0.1}]}, "step": 9}
    fastckpt.save(state, tmp_path / "ck")
    out = fastckpt.load(tmp_path / "ck", keys="model/w")
    assert set(out) == {"model"} and set(out["model"]) == {"w"}
    assert_same(out["model"]["w"], state["model"]["w"])
    out = fastckpt.load(tmp_path / "ck", keys=["optimizer", "step"])
    assert set(out) == {"optimizer", "step"} and out["step"] == 9
    assert_tree_same(state["optimizer"], out["optimizer"])
    # foreign files select by tensor name; no match is a KeyError
    save_file({"a": torch.ones(1), "b": torch.ones(2)}, str(tmp_path / "f.safetensors"))
    assert list(fastckpt.load(tmp_path / "f.safetensors", keys=["b"])) == ["b"]
    with pytest.raises(KeyError, match="nope"):
        fastckpt.load(tmp_path / "f.safetensors", keys="nope")


def test_streaming_mode_small_staging_budget(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {"model": {f"l{i}": torch.randn(300_000 + i, generator=g).to(torch.bfloat16) for i in range(5)},
             "small": [torch.randn(7, generator=g) for _ in range(20)], "odd": torch.randn(3, 333, generator=g).t()}
    total = sum(v.numel() * v.element_size() for v in state["model"].values())
    assert total > 2_900_000
    fut = fastckpt.async_save(state, tmp_path / "ck", staging_bytes=2 << 20, chunk_bytes=1 << 20,
                              max_shard_bytes=1_300_000)
    fut.result()
    out = fastckpt.load(tmp_path / "ck", chunk_bytes=1 << 20)
    assert_tree_same(state, out)
    assert fastckpt.verify(tmp_path / "ck").ok
    assert fastckpt.load(tmp_path / "ck", verify=True)["model"]["l3"].shape == (300_003,)


class DirectSpy(PosixBackend):
    """Counts writes that went through an O_DIRECT file descriptor."""

    def __init__(self):
        self.direct_writes = 0

    def pwrite(self, fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            self.direct_writes += 1
        return super().pwrite(fd, data, offset)


def _fs_has_o_direct(folder) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, ".probe"))
    return True


@pytest.mark.parametrize("n, chunk_bytes", [(1000 * 999, 1 << 20), (1250, 4096), (250_000, 1 << 16)])
def test_o_direct(tmp_path, n, chunk_bytes):
    # small states used to stage into a torch.empty buffer that is not page aligned: EINVAL
    state = {"model": {"w": torch.randn(n), "b": torch.randn(3)}, "x": torch.arange(5)}
    spy = DirectSpy()
    fastckpt.save(state, tmp_path / "ck", o_direct=True, chunk_bytes=chunk_bytes, io_backend=spy)
    assert_tree_same(state, fastckpt.load(tmp_path / "ck"))
    assert fastckpt.verify(tmp_path / "ck").ok
    if _fs_has_o_direct(tmp_path):
        assert spy.direct_writes > 0


def test_hf_shard_naming_and_index(tmp_path):
    model = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    model["lm_head.weight"] = torch.randn(10)
    fastckpt.save({"model": model, "optimizer": {"m": torch.ones(3)}}, tmp_path / "ck", max_shard_bytes=40_000,
                  metadata={"format": "pt"})
    names = sorted(n for n in os.listdir(tmp_path / "ck") if n.startswith("model-"))
    n = len(names)
    assert n >= 2 and names == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    ix = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert set(ix["weight_map"]) == set(model) and set(ix["weight_map"].values()) == set(names)
    assert ix["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.values())
    for name, shard in ix["weight_map"].items():
        with safe_open(str(tmp_path / "ck" / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert_same(model[name], f.get_tensor(name), name)
    # the folder also loads as a foreign HF model folder would: by tensor name, through the index
    flat = {}
    for shard in names:
        flat.update(load_file(str(tmp_path / "ck" / shard)))
    assert flat.keys() == model.keys()


def test_foreign_single_file_and_hf_folders(tmp_path):
    ts = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int8), "s": torch.tensor(2.5, dtype=torch.float64)}
    save_file(ts, str(tmp_path / "one.safetensors"), metadata={"k": "v"})
    out = fastckpt.load(tmp_path / "one.safetensors")
    assert out.keys() == ts.keys()
    for k in ts:
        assert_same(ts[k], out[k], k)
    # HF folder with an index
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": ts["a"]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": ts["b"], "s": ts["s"]}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 61}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                       "b": "model-00002-of-00002.safetensors",
                                                       "s": "model-00002-of-00002.safetensors"}}))
    out = fastckpt.load(d)
    for k in ts:
        assert_same(ts[k], out[k], k)
    # folder without an index: every *.safetensors file
    (d / "model.safetensors.index.json").unlink()
    out = fastckpt.load(d, keys=["s"])
    assert list(out) == ["s"] and out["s"].shape == ()
    with pytest.raises(CheckpointNotFoundError):
        fastckpt.load(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="nothing to load"):
        fastckpt.load(tmp_path / "empty")


def test_flipped_byte_detected_by_verify_and_load_verify(tmp_path):
    p = fastckpt.save({"model": {"w": torch.randn(100)}, "b": torch.randn(10)}, tmp_path / "ck")
    e = manifest(p)["tensors"]["model/w"]
    with open(p / e["file"], "r+b") as f:
        f.seek(e["offsets"][0] + 17)
        c = f.read(1)
        f.seek(e["offsets"][0] + 17)
        f.write(bytes([c[0] ^ 0x01]))
    rep = fastckpt.verify(p)
    assert not rep.ok and len(rep.problems) == 1
    assert "'model/w'" in rep.problems[0] and e["file"] in rep.problems[0]
    with pytest.raises(ChecksumMismatchError) as ei:
        fastckpt.load(p, verify=True)
    assert ei.value.tensor == "model/w" and e["file"] in str(ei.value)
    fastckpt.load(p, keys="b", verify=True)  # untouched tensors still load
    # a shard whose size no longer matches the manifest is refused before reading
    with open(p / e["file"], "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCheckpointError, match="manifest says"):
        fastckpt.load(p)


def test_options_validated_before_any_file(tmp_path):
    for opts in ({"chunk_bytes": 1000}, {"max_shard_bytes": 0}, {"threads": 0}, {"staging_bytes": -1},
                 {"extra_files": {"manifest.json": b""}}, {"metadata": {"a": 1}},
                 {"weights": ["model"]}, {"weights": {"model": "../b"}}, {"weights": {"model": "a//b"}},
                 {"weights": {"model": ".hidden/b"}}, {"extra_files": {"../x.json": b""}}):
        with pytest.raises((ValueError, UnsupportedValueError)):
            fastckpt.save(small_state(), tmp_path / "ck", **opts)
    with pytest.raises(TypeError):
        fastckpt.save(small_state(), tmp_path / "ck", no_such_option=1)
    assert listing(tmp_path) == []


def test_weights_and_extra_files_in_a_sub_folder(tmp_path):
    """peft saves a second adapter as NAME/adapter_model.safetensors + NAME/adapter_config.json:
    a weights stem and an extra file may name a sub-folder; both are committed, listed and verified."""
    state = {"model": {"w": torch.arange(6.0)}, "extra": {"a": torch.ones(3)}}
    p = fastckpt.save(state, tmp_path / "ck", weights={"model": "model", "extra": "sub/extra.safetensors"},
                      extra_files={"sub/config.json": b'{"r": 2}'})
    assert (p / "sub" / "config.json").read_bytes() == b'{"r": 2}'
    assert load_file(str(p / "sub" / "extra.safetensors")).keys() == {"a"}
    m = manifest(p)
    assert {"sub/extra.safetensors", "sub/config.json", "model.safetensors"} <= set(m["files"])
    assert_same(fastckpt.load(p)["extra"]["a"], state["extra"]["a"])
    assert fastckpt.verify(p).ok
    with open(p / "sub" / "config.json", "r+b") as f:
        f.write(b"X")
    assert not fastckpt.verify(p).ok


def test_extra_files_and_step_in_manifest(tmp_path):
    p = fastckpt.save(small_state(), tmp_path / "ck", extra_files={"config.json": b'{"a": 1}'}, step=12)
    assert (p / "config.json").read_bytes() == b'{"a": 1}'
    m = manifest(p)
    assert m["step"] == 12 and m["format_version"] >= 1 and "config.json" in m["files"]
    assert all(os.path.getsize(p / n) == f["bytes"] for n, f in m["files"].items())


def test_uncommitted_folder_is_not_a_checkpoint(tmp_path):
    p = fastckpt.save(small_state(), tmp_path / "ck")
    os.unlink(p / "manifest.json")
    assert not fastckpt.is_committed(p)
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        fastckpt.load(p)


_leaf = st.one_of(st.integers(-10, 10), st.floats(allow_nan=True), st.text(max_size=3),
                  st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 5),
                            st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])))
_state = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.tuples(c),
                                                 st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)),
                                                                 c, max_size=3)), max_leaves=8)


@settings(max_examples=25, deadline=None)
@given(state=_state)
def test_save_load_roundtrip_any_tree(tmp_path_factory, state):
    d = tmp_path_factory.mktemp("h") / "ck"
    fastckpt.save(state, d)
    assert_tree_same(state, fastckpt.load(d))


def test_failed_overwrite_keeps_old_checkpoint(tmp_path):
    p = fastckpt.save(small_state(1), tmp_path / "ck")
    be = FaultyBackend(fail_pwrite_after=0, err=errno.EIO)
    with pytest.raises(OSError) as ei:
        fastckpt.save(small_state(2), p, overwrite=True, io_backend=be)
    assert ei.value.errno == errno.EIO
    assert_tree_same(small_state(1), fastckpt.load(p))
    assert listing(tmp_path) == ["ck"] and fastckpt.verify(p).ok


def test_result_timeout_and_uncollected_failure_fails_the_exit(tmp_path):
    from fastckpt.saving.saver import Saver
    saver = Saver()
    fut = saver.async_save(small_state(), tmp_path / "slow", io_backend=SlowBackend(0.5))
    with pytest.raises(TimeoutError):
        fut.result(timeout_s=0.01)
    assert fut.result() == tmp_path / "slow" and fut.total_s >= fut.blocking_s > 0
    bad = saver.async_save(small_state(), tmp_path / "bad", io_backend=FaultyBackend(fail_pwrite_after=0))
    bad.exception()
    with pytest.raises(OSError):
        saver.wait()  # collected now
    saver.wait()
    # at interpreter exit, a failure nobody collected is reported on stderr with exit status 1
    code = ("import sys, torch, fastckpt; sys.path.insert(0, %r); from conftest import FaultyBackend; "
            "fastckpt.async_save({'w': torch.ones(1000)}, %r, io_backend=FaultyBackend(fail_pwrite_after=0))"
            % (os.path.dirname(os.path.dirname(__file__)), str(tmp_path / "lost")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "lost" in out.stderr and "FAILED" in out.stderr, out.stderr
    assert not (tmp_path / "lost").exists()


def test_many_small_mixed_tensors_stage_in_batched_runs(tmp_path):
    """Runs of back-to-back same-dtype tensors are staged by one torch.cat: mixed dtypes, odd
    sizes, strided and empty tensors in between must still land byte-exact where the header says."""
    g = torch.Generator().manual_seed(3)
    state = {"model": {}}
    kinds = [torch.float32, torch.float32, torch.bfloat16, torch.uint8, torch.float32, torch.int64, torch.bool]
    for i in range(300):
        dt = kinds[i % len(kinds)]
        n = 1 + (i * 37) % 129
        t = (torch.rand(n, generator=g) > 0.5) if dt == torch.bool else (torch.randn(n, generator=g) * 50).to(dt)
        if i % 11 == 0:
            t = torch.randn(n, 3, generator=g).t()[1]  # strided view
        if i % 23 == 0:
            t = torch.empty(0, dtype=dt)
        state["model"][f"t{i:03d}"] = t
    fastckpt.save(state, tmp_path / "c")
    back = fastckpt.load(tmp_path / "c")["model"]
    for k, v in state["model"].items():
        assert raw(back[k]) == raw(v), k
    theirs = load_file(str(tmp_path / "c" / "model.safetensors"))
    for k, v in state["model"].items():
        assert raw(theirs[k]) == raw(v), k


@pytest.mark.parametrize("call, expect_early", [("async_save", False), ("save", True)])
def test_early_writes_only_where_the_caller_waits_for_the_whole_save(tmp_path, monkeypatch, call, expect_early):
    """async_save: the disk starts after the copy (training waits only for the copy);
    save: writes overlap the copy (the caller waits for both anyway). Strided tensors make ``save``
    stage (contiguous CPU tensors it writes without staging: test_direct_save.py)."""
    from fastckpt.saving import saver
    staged, during = [False], []
    real_stage, real_write = saver.SaveJob.stage, saver.SaveJob._write_unit

    def stage(job, *a, **kw):
        real_stage(job, *a, **kw)
        staged[0] = True

    def write_unit(job, *a, **kw):
        during.append(not staged[0])
        return real_write(job, *a, **kw)
    monkeypatch.setattr(saver.SaveJob, "stage", stage)
    monkeypatch.setattr(saver.SaveJob, "_write_unit", write_unit)
    state = {"model": {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}}  # 64 MiB, 8 units
    if call == "save":
        state = {"model": {k: v.reshape(2, -1).t() for k, v in state["model"].items()}}  # strided: staged
    out = getattr(fastckpt, call)(state, tmp_path / "c")
    if call == "async_save":
        out.result()
    assert len(during) >= 8 and any(during) == expect_early
    assert_tree_same(fastckpt.load(tmp_path / "c"), state)


# -- defer: copies left to the background thread (pipelined snapshot) --------------------------

def _defer_state():
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(300, 257))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.sum().backward()
    opt.step()
    return w, opt, lambda: {"model": {"w": w, "buf": torch.arange(10.0)}, "optimizer": opt.state_dict()}


def _is_param_or_opt(k, trainable):
    return trainable or k.startswith("optimizer/")


def test_defer_copies_in_the_background_until_staged(tmp_path, monkeypatch):
    from fastckpt.saving import job as save_job
    w, opt, state = _defer_state()
    expect = {"w": raw(w), "exp_avg": raw(opt.state[w]["exp_avg"])}
    go, real = threading.Event(), save_job.SaveJob.write_all
    monkeypatch.setattr(save_job.SaveJob, "write_all", lambda job: (go.wait(30), real(job))[1])
    fut = fastckpt.async_save(state(), tmp_path / "c", defer=_is_param_or_opt)
    assert not fut.wait_staged(0.2)  # the parameter and optimizer state are not copied yet
    go.set()
    assert fut.wait_staged(30)
    with torch.no_grad():  # allowed once staged: the checkpoint keeps the call-time bytes
        w.mul_(2)
        opt.state[w]["exp_avg"].zero_()
    fut.result()
    out = fastckpt.load(tmp_path / "c")
    assert raw(out["model"]["w"]) == expect["w"]
    assert raw(out["optimizer"]["state"][0]["exp_avg"]) == expect["exp_avg"]
    assert torch.equal(out["model"]["buf"], torch.arange(10.0))
    assert fastckpt.verify(tmp_path / "c").ok


@pytest.mark.parametrize("what", ["optimizer", "parameter"])
def test_defer_write_before_staged_fails_the_save(tmp_path, monkeypatch, what):
    from fastckpt.saving import job as save_job
    from fastckpt.errors import SourceChangedError
    w, opt, state = _defer_state()
    fastckpt.save(state(), tmp_path / "c0")
    go, real = threading.Event(), save_job.SaveJob.write_all
    monkeypatch.setattr(save_job.SaveJob, "write_all", lambda job: (go.wait(30), real(job))[1])
    fut = fastckpt.async_save(state(), tmp_path / "c1", defer=_is_param_or_opt)
    with torch.no_grad():  # the training loop did not wait: the call-time bytes are gone
        (opt.state[w]["exp_avg"] if what == "optimizer" else w).add_(1)
    go.set()
    with pytest.raises(SourceChangedError, match=("optimizer/state/0/" if what == "optimizer" else "model/w")
                       + ".*written in place"):
        fut.result()
    assert fut.wait_staged(0)  # a failed save never leaves a waiter hanging
    assert not (tmp_path / "c1").exists() and fastckpt.verify(tmp_path / "c0").ok
    assert [p.name for p in tmp_path.iterdir()] == ["c0"]


def test_defer_is_validated(tmp_path):
    with pytest.raises(ValueError, match="defer must be a callable"):
        fastckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "c", defer=True)


def test_no_defer_is_staged_at_return(tmp_path):
    fut = fastckpt.async_save({"model": {"w": torch.ones(2)}}, tmp_path / "c")
    assert fut.wait_staged(0)
    fut.result()


def test_defer_large_tensors_are_copied_and_hashed_in_pieces(tmp_path):
    """Deferred tensors >= 1 MiB are staged and hashed piece by piece: bytes and manifest
    checksums must be those of the call, whatever the piece boundaries."""
    torch.manual_seed(5)
    big = {"a": torch.nn.Parameter(torch.randn(1300, 1001)),   # 5.2 MB, not a multiple of a piece
           "b": torch.nn.Parameter(torch.randn(1 << 20, dtype=torch.float64)),  # 8 MiB
           "c": torch.randn(3, 5)}
    fut = fastckpt.async_save({"model": big}, tmp_path / "c", defer=lambda k, trainable: trainable)
    fut.result()
    out = fastckpt.load(tmp_path / "c")["model"]
    for k, v in big.items():
        assert raw(out[k]) == raw(v), k
    rep = fastckpt.verify(tmp_path / "c")
    assert rep.ok, rep
    import xxhash
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert doc["tensors"]["model/a"]["xxh3"] == xxhash.xxh3_64(raw(big["a"])).hexdigest()


@pytest.mark.parametrize("fn", ["save", "async_save"])
def test_save_signature_is_typed_and_matches_save_options(fn):
    """issue 21: every option is an explicit keyword-only parameter with a type and the default of
    SaveOptions / IOTuning / Consistency (no **options), so IDEs and type checkers see them."""
    import dataclasses
    import inspect

    from fastckpt.saving.options import _TOP  # noqa: PLC2701 (the option names, test only)
    sig = inspect.signature(getattr(fastckpt, fn))
    params = dict(sig.parameters)
    assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    names = set(_TOP) | {f.name for f in dataclasses.fields(fastckpt.IOTuning)} \
        | {f.name for f in dataclasses.fields(fastckpt.Consistency)}
    assert set(params) == {"state", "path", "process_group"} | names
    for n in names | {"process_group"}:
        assert params[n].kind is inspect.Parameter.KEYWORD_ONLY and params[n].annotation is not inspect.Parameter.empty, n
    defaults = {f.name: f.default for f in dataclasses.fields(fastckpt.IOTuning)}
    defaults |= {f.name: f.default for f in dataclasses.fields(fastckpt.Consistency)}
    defaults |= {k: v.default for k, v in inspect.signature(fastckpt.SaveOptions).parameters.items() if k in _TOP}
    defaults["early_writes"] = fn == "save"  # save overlaps copy and writes: the caller waits for both
    for n, d in defaults.items():
        assert params[n].default == d, (n, params[n].default, d)


def test_group_object_keeps_its_values_beside_flat_defaults(tmp_path):
    p = fastckpt.save({"model": {f"w{i}": torch.arange(1000.0) for i in range(3)}}, tmp_path / "a",
                      io=fastckpt.IOTuning(max_shard_bytes=4000), step=2)
    files = sorted(n for n in os.listdir(p) if n.startswith("model-") and n.endswith(".safetensors"))
    assert len(files) == 3, files  # io's 4000-byte shards, not the flat default of 5e9
    assert fastckpt.read_manifest(str(p)).step == 2


def test_lr_scheduler_milestones_counter_survives_a_round_trip(tmp_path):
    """MultiStepLR keeps its milestones in a collections.Counter and SequentialLR calls a method of it
    at each milestone; a state read back with a plain dict there crashed the resumed run at its next
    milestone ('dict' object has no attribute 'elements', a Lightning resume in a handoff probe). The
    reference is the same scheduler run without interruption."""
    from collections import Counter

    def sched(opt):
        return torch.optim.lr_scheduler.SequentialLR(
            opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=3),
                  torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 3])], milestones=[4])

    def opt_of():
        return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.01)
    o = opt_of()
    s = sched(o)
    ref = []
    for step in range(8):
        o.step()
        s.step()
        if step == 1:
            fastckpt.save({"sched": s.state_dict()}, tmp_path / "ck")
        ref.append(o.param_groups[0]["lr"])
    back = fastckpt.load(tmp_path / "ck")["sched"]
    assert type(back["_schedulers"][1]["milestones"]) is Counter
    o2 = opt_of()
    s2 = sched(o2)
    s2.load_state_dict(back)
    o2.param_groups[0]["lr"] = ref[1]
    got = []
    for _ in range(6):
        o2.step()
        s2.step()
        got.append(o2.param_groups[0]["lr"])
    assert got == ref[2:]


def test_a_weights_key_the_state_lacks_is_refused_before_any_file(tmp_path):
    """weights={'modle': 'model'} saved no model.safetensors (not an HF folder) and said nothing."""
    sd = {"w": torch.ones(2)}
    with pytest.raises(fastckpt.errors.InvalidArgumentError, match="'modle'.*did you mean 'model'"):
        fastckpt.save({"model": sd}, tmp_path / "ck", weights={"modle": "model"})
    assert not (tmp_path / "ck").exists()
    fastckpt.save({"model": sd}, tmp_path / "ck", weights={"model": "model"})
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    fastckpt.save({"other": sd}, tmp_path / "ck2")  # the default {"model": "model"} never refuses


def test_a_nested_model_dict_says_no_hf_file_is_written(tmp_path, caplog):
    """USAGE.md: state["model"] becomes model.safetensors. A nested one ({"enc": {"w": t}}) cannot (HF
    files need flat names) and was saved into state-*.safetensors silently, even with weights= given.
    Now: weights= given -> refused before any file; the default -> a WARNING naming a nested key."""
    import logging
    nested = {"model": {"enc": {"w": torch.ones(2)}}}
    with pytest.raises(fastckpt.errors.InvalidArgumentError, match="nested dicts.*'model/enc/w'"):
        fastckpt.save(nested, tmp_path / "ck", weights={"model": "model"})
    assert not (tmp_path / "ck").exists()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save(nested, tmp_path / "ck")
    assert any("no model.safetensors is written" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "ck" / "model.safetensors").exists()
    assert torch.equal(fastckpt.load(tmp_path / "ck")["model"]["enc"]["w"], torch.ones(2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save({"model": {"w": torch.ones(2)}, "opt": {"a": {"b": torch.ones(1)}}}, tmp_path / "flat")
    assert not [r for r in caplog.records if "nested dicts" in r.getMessage()]
    assert (tmp_path / "flat" / "model.safetensors").is_file()


@pytest.mark.parametrize("stem", ["state", "rank00001", "sub/state"])
def test_a_weights_stem_of_fastckpts_own_files_is_refused(tmp_path, stem):
    """weights={'model': 'state'} merged the model's files into fastckpt's own state-0000k-of-0000n series
    (no HF index, no format metadata) with no word (a README-only trial); refused at the call."""
    from fastckpt.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="stems of fastckpt's own files"):
        fastckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "ck", weights={"model": stem})
    assert not (tmp_path / "ck").exists()
