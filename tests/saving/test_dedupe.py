"""link_from / link_unchanged: unchanged shard files are hard-linked, changed ones rewritten, exactly."""

import os
import shutil
import threading

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.errors import LinkedTensorChangedError, SourceChangedError

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
    shard = "model-00001-of-00001.safetensors"  # a peft checkpoint (adapter_model.safetensors): indexed base
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


def test_link_from_uncommitted_or_missing_is_ignored_with_a_warning(tmp_path, caplog):
    """Ignored (every file written), and said: a mistyped link_from was accepted silently."""
    import logging
    t = {"w": torch.arange(10.0)}
    (tmp_path / "junk").mkdir()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save({"model": t}, tmp_path / "a", link_from=tmp_path / "junk")
        fastckpt.save({"model": t}, tmp_path / "b", link_from=tmp_path / "nope")
    assert torch.equal(fastckpt.load(tmp_path / "b")["model"]["w"], t["w"])
    assert os.stat(tmp_path / "b" / "model.safetensors").st_nlink == 1
    said = [r.getMessage() for r in caplog.records if "nothing hard-linked" in r.getMessage()]
    assert len(said) == 2 and str(tmp_path / "nope") in said[1], said


def test_manager_link_unchanged_and_retention(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, link_unchanged=True)
    base = {"w": torch.randn(256, 256)}
    for step in (1, 2, 3):
        mgr.save(step, {"model": base, "opt": {"lr": step * 0.1, "m": torch.full((3,), float(step))}})
    assert mgr.steps() == [3]
    out = mgr.load()
    assert torch.equal(out["model"]["w"], base["w"]) and out["opt"]["m"].tolist() == [3.0, 3.0, 3.0]
    assert fastckpt.verify(mgr.path(3)).ok


# ---- link_check="version": unchanged tensors proven by storage identity + version counter ----------
SHARD = "model-00001-of-00001.safetensors"  # W is a peft layout: the base keeps the indexed name
ONE_SHARD = "model.safetensors"  # a plain model folder: one shard, no index


def _params():
    base = {f"w{i}": torch.nn.Parameter(torch.randn(256, 256), requires_grad=False) for i in range(3)}
    lora = {"a": torch.nn.Parameter(torch.randn(8, 256))}
    return base, lora


def _snap(base, lora):  # the live parameters, as the Trainer callback's snapshot gives them
    return _state(dict(base), dict(lora))


def _hash_threads(monkeypatch):
    """Record the data pointer of every source tensor the saver hashes."""
    from fastckpt.saving import dedupe
    seen = []
    real = dedupe.source_hash

    def spy(t):
        seen.append(t.data_ptr())
        return real(t)
    monkeypatch.setattr(dedupe, "source_hash", spy)
    return seen


def test_version_link_skips_hashing_at_the_call_and_verifies_later(tmp_path, monkeypatch):
    base, lora = _params()
    fastckpt.save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version")
    with torch.no_grad():
        lora["a"].add_(1)
    seen = _hash_threads(monkeypatch)
    from fastckpt.saving import saver
    go, real_start = threading.Event(), saver.SaveJob.start_verify
    monkeypatch.setattr(saver.SaveJob, "start_verify", lambda job: (go.wait(30), real_start(job))[1])
    fut = fastckpt.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1",
                              link_check="version")
    at_call = list(seen)  # the background part has not started yet
    go.set()
    fut.result()
    frozen = {v.data_ptr() for v in base.values()}
    # nothing hashed while the caller waited: the frozen tensors are known unchanged, the files
    # without frozen weights (adapter, optimizer) are staged without trying to link them
    assert at_call == []
    assert sorted(seen) == sorted(frozen)  # every linked tensor re-hashed in the background
    assert os.stat(tmp_path / "c2" / SHARD).st_ino == os.stat(tmp_path / "c1" / SHARD).st_ino
    assert fut.bytes_linked > 0
    out = fastckpt.load(tmp_path / "c2")
    for k, v in base.items():
        assert _raw(out["model"][k]) == _raw(v)
    assert _raw(out["adapter"]["a"]) == _raw(lora["a"])


def test_version_link_rewrites_a_tensor_changed_in_place(tmp_path):
    base, lora = _params()
    fastckpt.save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version")
    with torch.no_grad():
        base["w1"][0, 0] += 1.0  # a tracked in-place write bumps the version counter
    fastckpt.save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1", link_check="version")
    assert os.stat(tmp_path / "c2" / SHARD).st_ino != os.stat(tmp_path / "c1" / SHARD).st_ino
    assert _raw(fastckpt.load(tmp_path / "c2")["model"]["w1"]) == _raw(base["w1"])


def test_version_link_catches_a_write_through_data(tmp_path):
    base, lora = _params()
    fastckpt.save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version")
    before = _raw(base["w2"])
    base["w2"].data[5, 5] += 3.0  # bypasses the version counter
    fut = fastckpt.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1",
                              link_check="version")
    with pytest.raises(LinkedTensorChangedError, match="w2"):
        fut.result()
    assert not (tmp_path / "c2").exists()
    assert fastckpt.verify(tmp_path / "c1").ok
    assert _raw(fastckpt.load(tmp_path / "c1")["model"]["w2"]) == before
    # the failed save's tensors have no record: the next save hashes them and writes the new bytes
    fastckpt.save(_snap(base, lora), tmp_path / "c3", weights=W, link_from=tmp_path / "c1", link_check="version")
    assert _raw(fastckpt.load(tmp_path / "c3")["model"]["w2"]) == _raw(base["w2"])


def test_version_link_keeps_call_time_bytes_when_written_after_the_call(tmp_path):
    base, lora = _params()
    fastckpt.save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version")
    expect = _raw(base["w0"])
    fut = fastckpt.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1",
                              link_check="version")
    with torch.no_grad():
        base["w0"].mul_(2)  # tracked write after the call: the checkpoint keeps the call-time bytes
    fut.result()
    assert _raw(fastckpt.load(tmp_path / "c2")["model"]["w0"]) == expect


def test_version_link_never_matches_a_new_tensor(tmp_path):
    base, lora = _params()
    fastckpt.save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version")
    # same keys, shapes, dtype and version 0, other memory and bytes (e.g. a reloaded model)
    base = {k: torch.nn.Parameter(torch.randn(256, 256), requires_grad=False) for k in base}
    fastckpt.save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1", link_check="version")
    assert os.stat(tmp_path / "c2" / SHARD).st_nlink == 1
    out = fastckpt.load(tmp_path / "c2")
    for k, v in base.items():
        assert _raw(out["model"][k]) == _raw(v)


def test_link_check_is_validated(tmp_path):
    with pytest.raises(ValueError, match="link_check"):
        fastckpt.save({"x": torch.zeros(2)}, tmp_path / "c", link_check="mtime")
    with pytest.raises(ValueError, match="early_writes"):
        fastckpt.save({"x": torch.zeros(2)}, tmp_path / "c", early_writes="yes")
    assert not (tmp_path / "c").exists()


def test_plan_memo_follows_metadata(tmp_path):
    from safetensors import safe_open
    t = {"w": torch.arange(6.0)}
    fastckpt.save({"model": t}, tmp_path / "a", metadata={"run": "one"})
    fastckpt.save({"model": t}, tmp_path / "b", metadata={"run": "two"})
    with safe_open(str(tmp_path / "b" / ONE_SHARD), "pt") as f:
        assert f.metadata()["run"] == "two"


@pytest.mark.parametrize("fused", [True, False])
def test_version_link_never_trusts_trainable_parameters(tmp_path, fused):
    """AdamW(fused=True) steps parameters without bumping their version counter: a file that
    holds trainable parameters is always staged and written, never linked on the counter."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.AdamW([w], lr=0.1, fused=fused)
    frozen = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    state = lambda: {"model": {"w": w, "frozen": frozen}, "optimizer": opt.state_dict()}  # noqa: E731
    fastckpt.save(state(), tmp_path / "c1", link_check="version")
    v = w._version
    (w * frozen).sum().backward()
    opt.step()
    assert fused == (w._version == v)  # the trap this guards against
    fastckpt.save(state(), tmp_path / "c2", link_from=tmp_path / "c1", link_check="version")
    out = fastckpt.load(tmp_path / "c2")
    assert _raw(out["model"]["w"]) == _raw(w) and _raw(out["model"]["frozen"]) == _raw(frozen)
    assert os.stat(tmp_path / "c2" / ONE_SHARD).st_nlink == 1



# -- defer_frozen + prime_hashes: the first save of a run copies frozen weights in the background --

def _copy_spy(monkeypatch):
    """Record (thread name, keys) of every staging copy."""
    from fastckpt.saving import job as save_job
    seen = []
    real = save_job.SaveJob._copy_run

    def spy(job, run, sources):
        seen.append((threading.current_thread().name, [t.spec.key for t in run]))
        return real(job, run, sources)
    monkeypatch.setattr(save_job.SaveJob, "_copy_run", spy)
    return seen


def _gate_background(monkeypatch):
    """Hold the background part of the next save until the returned event is set."""
    from fastckpt.saving import job as save_job
    go, real = threading.Event(), save_job.SaveJob.write_all
    monkeypatch.setattr(save_job.SaveJob, "write_all", lambda job: (go.wait(30), real(job))[1])
    return go


def test_defer_frozen_copies_primed_weights_in_the_background(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    base, lora = _params()
    saver = fastckpt.saving.saver.Saver()
    assert saver.prime_hashes(_snap(base, lora), weights=W, background=False) == 3 * 256 * 256 * 4
    seen = _copy_spy(monkeypatch)
    go = _gate_background(monkeypatch)
    fut = saver.async_save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version",
                           defer_frozen=True)
    at_call = [k for _, ks in seen for k in ks]
    go.set()
    fut.result()
    assert not any(k.startswith("model/") for k in at_call) and "adapter/a" in at_call
    bg = {k for th, ks in seen if th != threading.current_thread().name for k in ks}
    assert bg == {f"model/w{i}" for i in range(3)}
    assert fut.bytes_linked == 0
    out = fastckpt.load(tmp_path / "c1")
    plain = load_file(str(tmp_path / "c1" / SHARD))  # the safetensors package reads our shard
    for k, v in base.items():
        assert _raw(out["model"][k]) == _raw(v) == _raw(plain[k])
    assert _raw(out["adapter"]["a"]) == _raw(lora["a"])
    assert fastckpt.verify(tmp_path / "c1").ok


def test_defer_frozen_without_a_record_copies_at_the_call(tmp_path, monkeypatch):
    base, lora = _params()
    saver = fastckpt.saving.saver.Saver()
    seen = _copy_spy(monkeypatch)
    saver.async_save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version",
                     defer_frozen=True).result()
    main = threading.current_thread().name
    assert {k for th, ks in seen if th == main for k in ks} >= {f"model/w{i}" for i in range(3)}
    with torch.no_grad():  # a tracked write after priming: the record is stale, copied at the call
        saver.prime_hashes(_snap(base, lora), weights=W, background=False)
        base["w1"].add_(1)
    seen.clear()
    saver.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_check="version",
                     defer_frozen=True).result()
    at_call = {k for th, ks in seen if th == main for k in ks}
    assert "model/w1" in at_call and "model/w0" not in at_call
    assert _raw(fastckpt.load(tmp_path / "c2")["model"]["w1"]) == _raw(base["w1"])


def test_defer_frozen_catches_a_write_through_data(tmp_path):
    base, lora = _params()
    saver = fastckpt.saving.saver.Saver()
    saver.prime_hashes(_snap(base, lora), weights=W, background=False)
    base["w2"].data[3, 3] += 1.0  # bypasses the version counter: the record lies
    fut = saver.async_save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version",
                           defer_frozen=True)
    with pytest.raises(LinkedTensorChangedError, match="w2"):
        fut.result()
    assert not (tmp_path / "c1").exists() and os.listdir(tmp_path) == []
    # the stale record was dropped: the next save copies w2 at the call and commits its bytes
    saver.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_check="version",
                     defer_frozen=True).result()
    assert _raw(fastckpt.load(tmp_path / "c2")["model"]["w2"]) == _raw(base["w2"])


def test_defer_frozen_refuses_a_write_after_the_call(tmp_path, monkeypatch):
    base, lora = _params()
    saver = fastckpt.saving.saver.Saver()
    fastckpt.save(_snap(base, lora), tmp_path / "c0", weights=W)
    saver.prime_hashes(_snap(base, lora), weights=W, background=False)
    go = _gate_background(monkeypatch)
    fut = saver.async_save(_snap(base, lora), tmp_path / "c1", weights=W, link_check="version",
                           defer_frozen=True)
    with torch.no_grad():
        base["w0"].mul_(2)  # before the background copy: the call-time bytes are gone
    go.set()
    with pytest.raises(SourceChangedError, match="w0.*written in place.*0 -> 1"):
        fut.result()
    assert not (tmp_path / "c1").exists() and fastckpt.verify(tmp_path / "c0").ok


def test_defer_frozen_units_shared_with_staged_tensors(tmp_path):
    """Small write units, and deferred and call-time tensors in the same file: each unit is
    written only once all its bytes are staged."""
    frozen = {f"f{i}": torch.nn.Parameter(torch.randn(100 + i, 301), requires_grad=False) for i in range(4)}
    plain = {f"p{i}": torch.randn(77, 33 + i) for i in range(4)}
    model = {k: v for pair in zip(frozen.items(), plain.items()) for k, v in pair}
    saver = fastckpt.saving.saver.Saver()
    saver.prime_hashes({"model": model}, background=False)
    saver.async_save({"model": model}, tmp_path / "c", link_check="version", defer_frozen=True,
                     chunk_bytes=16384).result()
    out = fastckpt.load(tmp_path / "c")["model"]
    assert list(out) == list(model)
    for k, v in model.items():
        assert _raw(out[k]) == _raw(v), k


def test_prime_then_link_skips_hashing_at_the_call(tmp_path, monkeypatch):
    """A new process (new Saver) resuming from c1: primed at train begin, its first save links
    the frozen weights from c1 without hashing them at the call."""
    base, lora = _params()
    fastckpt.saving.saver.Saver().async_save(_snap(base, lora), tmp_path / "c1", weights=W).result()
    saver = fastckpt.saving.saver.Saver()
    from fastckpt.saving import dedupe
    main, in_main, real = threading.current_thread(), [], dedupe.source_hash  # thread names
    monkeypatch.setattr(dedupe, "source_hash",
                        lambda t: (in_main.append(threading.current_thread().name), real(t))[1])
    saver.prime_hashes(_snap(base, lora), weights=W)  # background: the save waits for it
    go = _gate_background(monkeypatch)
    fut = saver.async_save(_snap(base, lora), tmp_path / "c2", weights=W, link_from=tmp_path / "c1",
                           link_check="version", defer_frozen=True)
    # hashed once each by the priming thread (then re-hashed in the background), none at the call
    assert in_main.count("fastckpt-prime") == 3 and main.name not in in_main
    go.set()
    fut.result()
    assert os.stat(tmp_path / "c2" / SHARD).st_ino == os.stat(tmp_path / "c1" / SHARD).st_ino


def test_defer_frozen_is_validated(tmp_path):
    with pytest.raises(ValueError, match="defer_frozen"):
        fastckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "c", defer_frozen="yes")


def test_defer_frozen_large_tensor_write_through_data_is_caught(tmp_path):
    """Same as above for a tensor staged and hashed piece by piece (>= 1 MiB)."""
    base = {"big": torch.nn.Parameter(torch.randn(1500, 1000), requires_grad=False)}
    saver = fastckpt.saving.saver.Saver()
    saver.prime_hashes({"model": base}, background=False)
    base["big"].data[-1, -1] += 1.0
    fut = saver.async_save({"model": base}, tmp_path / "c1", link_check="version", defer_frozen=True)
    with pytest.raises(LinkedTensorChangedError, match="big"):
        fut.result()
    assert not (tmp_path / "c1").exists()
