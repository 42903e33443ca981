"""fastckpt.load's argument errors: keys that match nothing, devices that are not there.

Both are refused, typed, before a byte of tensor data is read (a faulty backend that fails
every read proves it).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fastckpt
from fastckpt.errors import FastCkptError
from fastckpt.errors import DeviceUnavailableError, KeysNotFoundError
from fastckpt.loading.device import check_device
from fastckpt.storage.io import PosixBackend


class NoReads(PosixBackend):
    """A backend whose reads all fail: an error raised with it was raised before reading."""

    def preadv(self, fd, bufs, offset):
        raise AssertionError("read attempted")

    def open_read(self, path, o_direct=False):
        raise AssertionError(f"opened {path} for reading")


@pytest.fixture()
def ck(tmp_path):
    state = {"model": {"w": torch.arange(6.0), "b": torch.zeros(2)},
             "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}, "step": 7}
    return fastckpt.save(state, tmp_path / "ck"), state


@pytest.fixture()
def hf(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"model.embed.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2),
               "lm_head.weight": torch.ones(4, 2)}, p)
    return p


@pytest.mark.parametrize("keys", [["model/nope"], "model/nope", ["model/w", "model/nope"], ["nope"], [""]])
def test_key_matching_nothing_in_a_checkpoint_is_a_key_error(ck, keys):
    path, _ = ck
    with pytest.raises(KeysNotFoundError) as ei:
        fastckpt.load(path, keys=keys, io_backend=NoReads())
    e = ei.value
    assert isinstance(e, KeyError) and isinstance(e, FastCkptError)
    missing = [k for k in ([keys] if isinstance(keys, str) else keys) if k != "model/w"]
    assert e.keys == missing and e.path == str(path)
    msg = str(e)
    assert repr(missing[0]) in msg and str(path) in msg and not msg.startswith('"')
    if missing[0].startswith("model/"):  # names what exists where the key was looked for
        assert "under 'model'" in msg and "'model/b'" in msg and "'model/w'" in msg, msg
    else:
        assert "'model'" in msg and "'optimizer'" in msg and "'step'" in msg, msg


def test_close_key_is_suggested(ck):
    path, _ = ck
    with pytest.raises(KeyError, match=r"did you mean 'optimizer'"):
        fastckpt.load(path, keys="optimiser")


def test_matching_keys_still_select(ck):
    path, state = ck
    out = fastckpt.load(path, keys=["model/w", "step", "optimizer/param_groups"])
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and set(out["model"]) == {"w"}
    assert out["step"] == 7 and out["optimizer"] == {"param_groups": [{"lr": 0.1}]}
    assert set(fastckpt.load(path, keys="optimizer/")["optimizer"]) == {"state", "param_groups"}


def test_key_matching_nothing_in_a_foreign_file(hf):
    with pytest.raises(KeysNotFoundError, match=r"'model\.nope'.*did you mean 'model\.norm\.weight'") as ei:
        fastckpt.load(hf, keys=["lm_head.weight", "model.nope"], io_backend=NoReads())
    assert ei.value.keys == ["model.nope"]
    assert set(fastckpt.load(hf, keys=["lm_head.weight"])) == {"lm_head.weight"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_refused_before_reading(hf, device):
    with pytest.raises(DeviceUnavailableError) as ei:
        fastckpt.load(hf, device=device, io_backend=NoReads())
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError) and repr(device) in msg
    assert "CUDA is not available" in msg and "device='cpu'" in msg, msg


@pytest.mark.parametrize("device, words", [("gpu", "not a device torch understands"),
                                           ("cuda:x", "not a device torch understands"),
                                           ("xla:0", "cannot load into 'xla'"),
                                           ("npu:0", "NPU is not available")])
def test_unknown_device_is_refused_before_reading(hf, device, words):
    if device == "npu:0":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("an NPU stack is installed")
    with pytest.raises(DeviceUnavailableError, match=words) as ei:
        fastckpt.load(hf, device=device, io_backend=NoReads())
    assert repr(device) in str(ei.value) and "device='cpu'" in str(ei.value)


def test_device_checked_before_the_path(tmp_path):
    """A bad device is reported even when the path is fine to resolve or missing: nothing is opened."""
    with pytest.raises(DeviceUnavailableError):
        fastckpt.load(tmp_path / "does-not-exist", device="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_devices_is_refused(hf):
    n = torch.cuda.device_count()
    with pytest.raises(DeviceUnavailableError, match=f"only {n} cuda device"):
        fastckpt.load(hf, device=f"cuda:{n}", io_backend=NoReads())
    assert check_device("cuda:0") == torch.device("cuda:0")


def test_cpu_and_registered_devices_pass(monkeypatch):
    from fastckpt.loading.device import ENGINES, Engine
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError):
        check_device("meta")
    monkeypatch.setitem(ENGINES, "meta", lambda dev: Engine(torch.device("cpu")))
    assert check_device("meta") == torch.device("meta")


@pytest.mark.parametrize("opts", [{"chunk_bytes": "4MB"}, {"chunk_bytes": -5}, {"chunk_bytes": 0}])
def test_load_byte_options_are_checked_at_the_call(tmp_path, opts):
    """fastckpt.load(chunk_bytes='4MB') failed deep in the read (TypeError: unsupported operand) and
    chunk_bytes=-5 was taken (a README-only trial); load_into's buffer_bytes too. save() checks its own."""
    from fastckpt.errors import InvalidArgumentError
    p = fastckpt.save({"model": {"w": torch.ones(4)}}, tmp_path / "c")
    with pytest.raises(InvalidArgumentError, match=f"{next(iter(opts))} must be a positive int of bytes"):
        fastckpt.load(p, **opts)
    with pytest.raises(InvalidArgumentError, match="must be a positive int of bytes"):
        fastckpt.load_into({"model": {"w": torch.zeros(4)}}, p, **opts)
    with pytest.raises(InvalidArgumentError, match="buffer_bytes must be a positive int of bytes"):
        fastckpt.load_into({"model": {"w": torch.zeros(4)}}, p, buffer_bytes="64MB")
