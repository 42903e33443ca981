"""Reads are exact or refuse (issue 20, item 2), on fastckpt.load, load_into and CheckpointManager:

- a dtype difference is cast as DCP's FileSystemReader casts (``target.copy_(stored)``): the state holds
  ``saved.to(state_dtype)`` bit for bit, never reinterpreted bytes; a shape difference is refused in
  every ``strict`` mode;
- ``load_into`` follows ``dcp.load``: the state names what is read, the checkpoint's other keys are
  ignored; ``strict=True`` asks for both directions; keys left unfilled are reported and logged;
- checksums are checked by default: a flipped byte raises ChecksumMismatchError naming file and key.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import fastckpt
from fastckpt.format.dtypes import DTYPE_TO_STR
from fastckpt.errors import ChecksumMismatchError, StateMismatchError


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(40, 33, generator=g, dtype=torch.float64) * 100).to(dtype)  # values bf16 cannot hold
    b = (torch.randn(33, generator=g, dtype=torch.float64) * 1e-3).to(dtype)
    return {"model": {"w": w, "b": b, "ids": torch.arange(5)},
            "optim": {"state": {0: {"exp_avg": torch.randn(40, 33, generator=g)}}, "param_groups": [{"lr": 0.1}]},
            "step": 7}


@pytest.mark.parametrize("saved_dtype,state_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float16)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_dtype_difference_is_cast_like_dcp(tmp_path, saved_dtype, state_dtype, layout):
    saved = _state(saved_dtype)
    ck = fastckpt.save(saved, tmp_path / "ck")
    dst = {"model": {"w": torch.zeros(40, 33, dtype=state_dtype), "b": torch.zeros(33, dtype=state_dtype)}}
    if layout == "strided":
        dst["model"]["w"] = torch.zeros(33, 40, dtype=state_dtype).t()
    rep = fastckpt.LoadIntoReport()
    w = dst["model"]["w"]
    fastckpt.load_into(dst, ck, report=rep, buffer_bytes=200)  # several bounce blocks
    assert dst["model"]["w"] is w and w.dtype == state_dtype
    for k in ("w", "b"):
        want = saved["model"][k].to(state_dtype)
        assert _raw(dst["model"][k]) == _raw(want), k
        # DCP's own reader does exactly this copy_
        ref = torch.zeros_like(dst["model"][k])
        ref.copy_(saved["model"][k])
        assert _raw(ref) == _raw(want)
    sd, td = DTYPE_TO_STR[saved_dtype], DTYPE_TO_STR[state_dtype]
    assert sorted(rep.cast) == [("model/b", sd, td), ("model/w", sd, td)]
    assert rep.missing_keys == [] and "optim/state/0/exp_avg" in rep.unexpected_keys


def test_cast_from_hf_safetensors_file(tmp_path):
    from safetensors.torch import save_file
    t = {"layer.weight": torch.randn(4, 3, dtype=torch.float64).mul(1e3).to(torch.bfloat16)}
    save_file(t, str(tmp_path / "model.safetensors"))
    dst = {"layer.weight": torch.zeros(4, 3)}
    fastckpt.load_into(dst, tmp_path)
    assert _raw(dst["layer.weight"]) == _raw(t["layer.weight"].float())


@pytest.mark.parametrize("strict", [None, True, False])
def test_shape_difference_is_refused_in_every_mode(tmp_path, strict):
    ck = fastckpt.save(_state(torch.float32), tmp_path / "ck")
    dst = {"model": {"w": torch.zeros(40, 32), "b": torch.zeros(33)}}
    with pytest.raises(StateMismatchError) as ei:
        fastckpt.load_into(dst, ck, strict=strict)
    msg = str(ei.value)
    assert "'model/w'" in msg and "[40, 32]" in msg and "[40, 33]" in msg and ".safetensors" in msg, msg
    assert not dst["model"]["b"].any() and not dst["model"]["w"].any(), "a refused load_into wrote into the state"


def test_state_names_what_is_loaded_as_dcp_load(tmp_path, caplog):
    """The issue's case: a model-only state from a checkpoint that also holds the optimizer."""
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    ck = fastckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path / "ck")
    fresh = torch.nn.Linear(6, 4)
    rep = fastckpt.LoadIntoReport()
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        out = fastckpt.load_into({"model": fresh.state_dict()}, ck, report=rep)
    assert set(out) == {"model"}
    assert all(_raw(fresh.state_dict()[k]) == _raw(v) for k, v in model.state_dict().items())
    assert rep.missing_keys == [] and {"optimizer/state/0/exp_avg", "step"} <= set(rep.unexpected_keys)
    assert "ignored" in caplog.text and "optimizer/" in caplog.text
    # strict=True asks for both directions: the optimizer keys the state lacks raise, nothing written
    other = torch.nn.Linear(6, 4)
    other.weight.data.copy_(torch.zeros(4, 6))
    with pytest.raises(StateMismatchError, match="not in the state: 'optimizer/") as ei:
        fastckpt.load_into({"model": other.state_dict()}, ck, strict=True)
    assert "step" in ei.value.unexpected and not other.weight.any()


def test_missing_keys_raise_by_default_and_are_reported_with_strict_false(tmp_path, caplog):
    ck = fastckpt.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck")
    dst = {"model": {"w": torch.zeros(3), "extra": torch.full((2,), 5.0)}}
    with pytest.raises(StateMismatchError, match="missing from the checkpoint: 'model/extra'") as ei:
        fastckpt.load_into(dst, ck)
    assert ei.value.missing == ["model/extra"] and not dst["model"]["w"].any()
    rep = fastckpt.LoadIntoReport()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.load_into(dst, ck, strict=False, report=rep)
    assert rep.missing_keys == ["model/extra"] and rep.unexpected_keys == []
    assert torch.equal(dst["model"]["w"], torch.ones(3)) and torch.equal(dst["model"]["extra"], torch.full((2,), 5.0))
    assert any(r.levelno == logging.WARNING and "model/extra" in r.getMessage() for r in caplog.records), caplog.text


def _flip_byte(ck, key: str) -> str:
    e = fastckpt.read_manifest(ck).tensors[key]
    f = os.path.join(ck, e.file)
    with open(f, "r+b") as fh:
        fh.seek(e.offsets[0] + 5)
        b = fh.read(1)
        fh.seek(e.offsets[0] + 5)
        fh.write(bytes([b[0] ^ 0x01]))
    return e.file


def test_flipped_byte_raises_on_every_resume_path_by_default(tmp_path):
    mgr = fastckpt.CheckpointManager(tmp_path / "run")
    saved = _state(torch.float32)
    ck = mgr.save(3, saved)
    fname = _flip_byte(ck, "model/w")

    def tmpl():
        return {"model": {"w": torch.zeros(40, 33), "b": torch.zeros(33)}}

    calls = {"fastckpt.load": lambda **kw: fastckpt.load(ck, **kw),
             "CheckpointManager.load": lambda **kw: mgr.load(**kw),
             "fastckpt.load_into": lambda **kw: fastckpt.load_into(tmpl(), ck, **kw),
             "CheckpointManager.load_into": lambda **kw: mgr.load_into(tmpl(), **kw)}
    for name, call in calls.items():
        with pytest.raises(ChecksumMismatchError) as ei:
            call()
        assert "model/w" in str(ei.value) and fname in str(ei.value), (name, str(ei.value))
        assert "fastckpt verify" in str(ei.value), (name, "the error says how to go on")
        assert ei.value.tensor == "model/w" and ei.value.path.endswith(fname), name
        got = call(verify=False)  # the damaged byte comes back only when asked
        w = got["model"]["w"]
        assert _raw(w) != _raw(saved["model"]["w"]) and _raw(got["model"]["b"]) == _raw(saved["model"]["b"]), name


def test_flipped_byte_of_a_cast_tensor_is_caught(tmp_path):
    ck = fastckpt.save({"w": torch.randn(64, 8)}, tmp_path / "ck")
    fname = _flip_byte(ck, "w")
    with pytest.raises(ChecksumMismatchError, match="'w'") as ei:
        fastckpt.load_into({"w": torch.zeros(64, 8, dtype=torch.bfloat16)}, ck)
    assert fname in str(ei.value)
    fastckpt.load_into({"w": torch.zeros(64, 8, dtype=torch.bfloat16)}, ck, verify=False)


def test_flipped_byte_raises_through_dcp_load_by_default(tmp_path):
    """The DCP way in (torchtitan's manager reads through FastCkptReader) checks checksums by default too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import fastckpt.dcp
    from fastckpt.errors import DCPLoadError

    saved = _state(torch.float32)
    ck = fastckpt.save(saved, tmp_path / "ck")
    fname = _flip_byte(ck, "model/w")

    def tmpl():
        return {"model": {"w": torch.zeros(40, 33), "b": torch.zeros(33)}}

    with pytest.raises(CheckpointException) as ei:
        dcp.load(tmpl(), storage_reader=fastckpt.dcp.FastCkptReader(ck))
    assert "ChecksumMismatchError" in repr(ei.value.failures) and fname in repr(ei.value.failures)
    with pytest.raises(DCPLoadError, match="ChecksumMismatchError"):
        fastckpt.dcp.load(tmpl(), ck)
    got = tmpl()
    dcp.load(got, storage_reader=fastckpt.dcp.FastCkptReader(ck, verify=False))  # only when asked
    assert _raw(got["model"]["w"]) != _raw(saved["model"]["w"])
    assert _raw(got["model"]["b"]) == _raw(saved["model"]["b"])
