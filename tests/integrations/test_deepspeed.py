"""DeepSpeed engine: real DeepSpeed 0.19 on CPU (gloo, one rank) when installed, plus the interface."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointNotFoundError
from fastckpt.integrations.deepspeed import FastCkptCheckpointEngine, decode, encode, install


def test_engine_interface_roundtrip(tmp_path):
    """The calls DeepSpeed makes, with the files it would pass (works without DeepSpeed)."""
    ce = FastCkptCheckpointEngine()
    tag = tmp_path / "global_step1"
    ce.create(None)
    ce.makedirs(str(tag), exist_ok=True)
    state = {"module": {"w": torch.randn(3, 4)}, "param_shapes": [{"w": torch.Size([3, 4])}],
             "names": {"a", "b"}, "global_steps": 1, "ds_config": {"train_batch_size": 1}}
    ce.save(state, str(tag / "mp_rank_00_model_states.pt"))
    assert ce.commit(None) is True
    assert fastckpt.is_committed(tag / "mp_rank_00_model_states.pt")
    back = ce.load(str(tag / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert torch.equal(back["module"]["w"], state["module"]["w"])
    assert back["param_shapes"][0]["w"] == torch.Size([3, 4]) and back["names"] == {"a", "b"}
    with pytest.raises(CheckpointNotFoundError):
        ce.load(str(tag / "missing.pt"))


def test_codec_refuses_foreign_classes():
    class Foreign:
        pass
    with pytest.raises(fastckpt.UnsupportedValueError):
        encode({"x": Foreign()})
    with pytest.raises(fastckpt.UnsupportedValueError):
        decode({"__ds_obj__": "os:system", "state": {}})


@pytest.mark.parametrize("tag", [{"__ds_obj__": "torch.hub:set_dir", "fields": ["/tmp/evil"]},
                                 {"__ds_obj__": "torch.hub:set_dir", "state": {}},
                                 {"__ds_enum__": "torch.hub:set_dir", "value": "/tmp/evil"},
                                 {"__ds_obj__": ["not", "a", "name"], "state": {}}])
def test_decode_never_calls_what_the_checkpoint_names(tmp_path, tag, monkeypatch):
    """A checkpoint naming a torch/deepspeed callable is refused before anything is called."""
    import torch.hub
    from fastckpt.errors import UntrustedTypeError
    called = []
    monkeypatch.setattr(torch.hub, "set_dir", lambda *a: called.append(a))
    ckpt = tmp_path / "mp_rank_00_model_states.pt"
    ce = FastCkptCheckpointEngine()  # the engine writes the tagged dict as plain JSON, and the tag's marker
    ce.save({"x": tag}, str(ckpt))
    ce.commit(None)
    with pytest.raises(UntrustedTypeError) as e:
        FastCkptCheckpointEngine().load(str(ckpt))
    assert called == [] and str(ckpt) in str(e.value)
    assert repr(tag.get("__ds_obj__", tag.get("__ds_enum__"))) in str(e.value)


def test_codec_rebuilds_the_allowed_deepspeed_types():
    ds = pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    state = {"scaler": DynamicLossScaler(init_scale=2.0 ** 8, scale_window=10, min_scale=1,
                                                 delayed_shift=2, consecutive_hysteresis=False), "stage": ZeroStageEnum(3)}
    back = decode(encode(state))
    assert isinstance(back["scaler"], DynamicLossScaler) and back["scaler"].cur_scale == 2.0 ** 8
    assert back["stage"] is ZeroStageEnum(3)


def test_real_deepspeed_cpu_save_load(tmp_path, monkeypatch):
    ds = pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import socket
    with socket.socket() as sk:  # a free port: a fixed one clashes with other test runs on the machine
        sk.bind(("127.0.0.1", 0))
        port = str(sk.getsockname()[1])
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    # DeepSpeed's CPU comm JIT-compiles a shared-memory all-reduce op (minutes on 2 cores);
    # gloo is enough for one rank, so that build is skipped.
    import deepspeed.comm.torch  # noqa: F401
    monkeypatch.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    ds.init_distributed(dist_backend="gloo")
    try:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        eng, *_ = ds.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.1),
                                config={"train_batch_size": 1, "zero_optimization": {"stage": 1}})
        install(eng)
        eng.backward(eng(torch.randn(1, 4)).sum())
        eng.step()
        eng.save_checkpoint(str(tmp_path), tag="t1")
        assert (tmp_path / "latest").read_text().strip() == "t1"  # DeepSpeed's own pointer, unchanged meaning
        files = sorted(os.listdir(tmp_path / "t1"))
        assert files == ["fastckpt_tag.json", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        assert all(fastckpt.is_committed(tmp_path / "t1" / f) for f in files[1:])
        w = eng.module.weight.detach().clone()
        with torch.no_grad():
            eng.module.weight.zero_()
        eng.load_checkpoint(str(tmp_path))
        assert torch.equal(eng.module.weight.detach(), w)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
