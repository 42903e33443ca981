"""link_from / link_unchanged: unchanged shard files are hard-linked, changed ones rewritten, exactly."""

import os
import shutil

import torch

import fastckpt
from fastckpt import CheckpointManager

W = {"model": "model", "adapter": "adapter_model.safetensors"}


def _state(base, lora):
    return {"model": base, "adapter": lora, "optimizer": {"m": lora["a"] * 2}, "step": 1}


def _raw(t):
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_unchanged_files_are_linked_changed_rewritten(tmp_path):
    base = {f"w{i}": torch.randn(300, 300) for i in range(4)}
    lora = {"a": torch.randn(8, 300)}
    fastckpt.save(_state(base, lora), tmp_path / "c1", weights=W)
    lora["a"].add_(1)
    fastckpt.save(_state(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1")
    shard = "model-00001-of-00001.safetensors"
    assert os.stat(tmp_path / "c2" / shard).st_ino == os.stat(tmp_path / "c1" / shard).st_ino
    assert os.stat(tmp_path / "c2" / "adapter_model.safetensors").st_nlink == 1
    # a changed base tensor: the model shard is written anew, not linked
    base["w2"][3, 4] += 1.0
    expect = base["w2"].clone()
    fut = fastckpt.async_save(_state(base, lora), tmp_path / "c3", weights=W, link_from=tmp_path / "c2")
    base["w2"][3, 4] -= 7.0  # mutate right after the call: the checkpoint keeps the call-time value
    fut.result()
    assert os.stat(tmp_path / "c3" / shard).st_ino != os.stat(tmp_path / "c2" / shard).st_ino
    out = fastckpt.load(tmp_path / "c3")
    assert _raw(out["model"]["w2"]) == _raw(expect)
    # deleting the older checkpoint leaves the linked one whole
    shutil.rmtree(tmp_path / "c1")
    rep = fastckpt.verify(tmp_path / "c2")
    assert rep.ok, rep.problems
    out = fastckpt.load(tmp_path / "c2")
    for k, v in base.items():
        if k != "w2":
            assert _raw(out["model"][k]) == _raw(v)
    assert _raw(out["adapter"]["a"]) == _raw(lora["a"])


def test_link_from_uncommitted_or_missing_is_ignored(tmp_path):
    t = {"w": torch.arange(10.0)}
    (tmp_path / "junk").mkdir()
    fastckpt.save({"model": t}, tmp_path / "a", link_from=tmp_path / "junk")
    fastckpt.save({"model": t}, tmp_path / "b", link_from=tmp_path / "nope")
    assert torch.equal(fastckpt.load(tmp_path / "b")["model"]["w"], t["w"])
    assert os.stat(tmp_path / "b" / "model-00001-of-00001.safetensors").st_nlink == 1


def test_manager_link_unchanged_and_retention(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, link_unchanged=True)
    base = {"w": torch.randn(256, 256)}
    for step in (1, 2, 3):
        mgr.save(step, {"model": base, "opt": {"lr": step * 0.1, "m": torch.full((3,), float(step))}})
    assert mgr.steps() == [3]
    out = mgr.load()
    assert torch.equal(out["model"]["w"], base["w"]) and out["opt"]["m"].tolist() == [3.0, 3.0, 3.0]
    assert fastckpt.verify(mgr.path(3)).ok
