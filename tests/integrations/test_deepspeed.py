"""DeepSpeed engine: real DeepSpeed 0.19 on CPU (gloo, one rank) when installed, the interface, the
one-process failure path, and consolidation of hand-made ZeRO-1/2/3 partitions (2 ranks: test_deepspeed_multirank.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointNotFoundError
from fastckpt.integrations.deepspeed.engine import FastCkptCheckpointEngine, decode, encode, install


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


def test_failed_save_raises_at_commit_and_leaves_no_tag(tmp_path):
    """A value fastckpt cannot store is kept until commit (every rank must reach the vote), then
    raised with its own type in one process; the files of the tag are gone and no marker exists."""
    class Foreign:
        pass
    ce = FastCkptCheckpointEngine()
    tag = tmp_path / "t1"
    ce.create(None)
    ce.save({"w": torch.ones(2)}, str(tag / "mp_rank_00_model_states.pt"))
    ce.save({"x": Foreign()}, str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))  # no raise yet
    with pytest.raises(fastckpt.UnsupportedValueError, match="/x"):
        ce.commit(None)
    assert not os.path.exists(tag / "fastckpt_tag.json")
    assert not fastckpt.is_committed(tag / "mp_rank_00_model_states.pt")
    ce.create(None)  # the engine stays usable
    ce.save({"w": torch.ones(2)}, str(tag / "mp_rank_00_model_states.pt"))
    assert ce.commit(None) is True and (tag / "fastckpt_tag.json").is_file()


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
    import fastckpt.integrations.deepspeed.engine as engine_mod
    # a hostile checkpoint: the tagged dict written as it is (the engine's own encode would escape a
    # caller's dict of that form, see test_client_state_dicts_come_back_as_they_were), and the tag's marker
    monkeypatch.setattr(engine_mod, "encode", lambda v, path="": v)
    ce = FastCkptCheckpointEngine()
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
    from fastckpt.format.tree import flatten, unflatten
    skel = json.loads(json.dumps(flatten(encode(state), lambda k, v: None)))  # as state.json holds it
    back = decode(unflatten(skel, lambda k, kind: None))
    assert isinstance(back["scaler"], DynamicLossScaler) and back["scaler"].cur_scale == 2.0 ** 8
    assert back["stage"] is ZeroStageEnum(3)  # an IntEnum: it was stored as a plain int (a README-only trial)


def test_client_state_dicts_come_back_as_they_were(tmp_path):
    """A dict of the caller's whose key has the codec's tag form (``{"__ds_size__": [1, 2]}``) stays a
    dict (it came back as torch.Size) through the real fastckpt save and load of the encoded state; an
    OrderedDict comes back as an equal dict in the same order (DeepSpeed's torch.save keeps the type)."""
    from collections import OrderedDict
    state = {"od": OrderedDict([("b", 1), ("a", torch.ones(2))]), "user": {"__ds_size__": [1, 2], 3: "x"},
             "size": torch.Size([4, 5]), "nested": [OrderedDict(z=1)]}
    fastckpt.save(encode(state), tmp_path / "ck")
    back = decode(fastckpt.load(tmp_path / "ck"))
    assert list(back["od"]) == ["b", "a"] and back["od"]["b"] == 1 and torch.equal(back["od"]["a"], torch.ones(2))
    assert type(back["user"]) is dict and back["user"] == {"__ds_size__": [1, 2], 3: "x"}
    assert back["size"] == torch.Size([4, 5]) and type(back["size"]) is torch.Size
    assert back["nested"] == [{"z": 1}]


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
        # save_16bit_model goes through the checkpoint engine under the tag name of the current step:
        # it failed (no tag folder for the marker) and, with a committed tag of that name in the folder,
        # removed that tag's marker. Now the file DeepSpeed's own engine writes (a multi-rank probe).
        eng.save_checkpoint(str(tmp_path))  # the default tag: global_step{N}, the export's tag name too
        step_tag = f"global_step{eng.global_steps}"
        assert eng.save_16bit_model(str(tmp_path), "weights.bin") is True
        got = torch.load(tmp_path / "weights.bin", weights_only=True)
        assert got.keys() == eng.module.state_dict().keys()
        assert all(torch.equal(got[k].float(), v.float()) for k, v in eng.module.state_dict().items())
        assert (tmp_path / step_tag / "fastckpt_tag.json").is_file()  # the committed tag is still committed
        eng.load_checkpoint(str(tmp_path), tag=step_tag)
        # fastckpt verify SAVE_DIR checks every *_states.pt folder of the tag 'latest' names (it exited 2:
        # 'no checkpoints'), and names a flipped byte (a README-only trial)
        from fastckpt.cli.main import main as cli_main
        (tmp_path / "latest").write_text(step_tag)
        assert cli_main(["verify", str(tmp_path), "-q"]) == 0
        for cmd in (["ls", str(tmp_path)], ["prune", str(tmp_path), "--keep", "1"]):  # they said only
            err = io.StringIO()  # 'no step-N, checkpoint-N ... folders' (a README-only trial)
            with contextlib.redirect_stderr(err):
                assert cli_main(cmd) == 2
            assert "DeepSpeed save_dir written by fastckpt's engine" in err.getvalue() and step_tag in err.getvalue()
        shard = next((tmp_path / step_tag / "mp_rank_00_model_states.pt").glob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[-2] ^= 0x01
        shard.write_bytes(bytes(raw))
        assert cli_main(["verify", str(tmp_path), "-q"]) == 1
        assert cli_main(["verify", str(tmp_path / step_tag), "-q"]) == 1
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


# -- consolidation on hand-made partitions (odd sizes, padding, frozen, tied, buffers) -------------

def _zero_tag(tmp_path, stage: int, full: dict, world: int = 2, frozen: dict | None = None):
    """A tag as fastckpt's engine writes it for ``world`` ranks, partitioned as DeepSpeed does
    (ZeRO-1/2: one flat group padded to 2*world and cut in equal slices; ZeRO-3: each param cut in
    ceil(n/world) pieces, the last zero-padded)."""
    import math
    ce = FastCkptCheckpointEngine()
    tag = tmp_path / "run" / "step1"
    shapes = [{k: v.shape for k, v in full.items()}]
    frozen = frozen or {}
    if stage == 3:
        flats = [[] for _ in range(world)]
        for v in full.values():
            n, piece = v.numel(), math.ceil(v.numel() / world)
            padded = torch.cat([v.reshape(-1), torch.zeros(piece * world - n)])
            for r in range(world):
                flats[r].append(padded[r * piece:(r + 1) * piece])
        flats = [torch.cat(f) for f in flats]
    else:
        flat = torch.cat([v.reshape(-1) for v in full.values()])
        size = 2 * world * math.ceil(flat.numel() / (2 * world))
        flat = torch.cat([flat, torch.zeros(size - flat.numel())])
        flats = list(flat.chunk(world))
    for r in range(world):
        model = {"module": {**{k: torch.empty(0) for k in full}, "buf": torch.arange(3)}, "buffer_names": ["buf"],
                 "param_shapes": shapes, "shared_params": {"alias": "a"},
                 "frozen_param_shapes": {k: v.shape for k, v in frozen.items()},
                 "frozen_param_fragments": {k: (v.reshape(-1).chunk(world)[r] if stage == 3 else v)
                                            for k, v in frozen.items()}}
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        if stage == 3 or r == 0:
            ce.save(model, str(tag / name))
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        ce.save({"optimizer_state_dict": {"zero_stage": stage, "partition_count": world if stage == 3 else [world],
                                          key: [flats[r].clone()]}},
                str(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    ce.commit(None)
    (tmp_path / "run" / "latest").write_text("step1")
    return tmp_path / "run"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidate_rebuilds_odd_sized_partitions(tmp_path, stage):
    from fastckpt.loading.zero import consolidate, find_zero_tag
    g = torch.Generator().manual_seed(stage)
    full = {"a": torch.randn(3, generator=g), "b": torch.randn(2, 3, generator=g), "c": torch.randn(5, generator=g)}
    frozen = {"f": torch.randn(4, generator=g)}
    run = _zero_tag(tmp_path, stage, full, frozen=frozen)
    sd, info = consolidate(find_zero_tag(str(run)))
    assert (info.stage, info.world_size) == (stage, 2)
    assert set(sd) == {"a", "b", "c", "f", "buf"}  # the tied alias is left out, as save_pretrained does
    for k, v in {**full, **frozen}.items():
        assert torch.equal(sd[k], v), k
    assert torch.equal(sd["buf"], torch.arange(3))


def test_consolidate_refuses_partitions_that_do_not_add_up(tmp_path):
    from fastckpt.errors import CorruptCheckpointError
    from fastckpt.loading.zero import consolidate, find_zero_tag
    run = _zero_tag(tmp_path, 3, {"a": torch.ones(6)})
    tag = run / "step1"
    ce = FastCkptCheckpointEngine()  # rank 0's model states now claim a bigger parameter
    for r in range(2):
        ce.save({"module": {"a": torch.empty(0)}, "buffer_names": [], "param_shapes": [{"a": torch.Size([9])}],
                 "shared_params": {}}, str(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    ce.commit(None)
    with pytest.raises(CorruptCheckpointError, match="'a'|a \\[9\\]"):
        consolidate(find_zero_tag(str(run)))


def test_latest_naming_outside_the_folder_is_not_followed(tmp_path):
    """A ``latest`` naming a path (not a tag folder inside save_dir) is never followed, even to a
    complete tag."""
    from fastckpt.loading.zero import find_zero_tag
    run = _zero_tag(tmp_path, 2, {"a": torch.ones(4)})
    other = tmp_path / "other"
    other.mkdir()
    (other / "latest").write_text("../run/step1")
    assert find_zero_tag(str(other)) is None
    assert find_zero_tag(str(run)) == str(run / "step1")


def test_client_state_frozenset_and_defaultdict(tmp_path, caplog):
    """A frozenset in client_state came back as a set, and a defaultdict as a dict with no word
    (a DeepSpeed differential probe: DeepSpeed's own engine returns both unchanged). The frozenset is
    tagged and comes back as one; the defaultdict is a dict with fastckpt's WARNING (its factory is
    not stored: no class or callable named by a checkpoint is ever built)."""
    from collections import defaultdict
    from fastckpt.format import tree
    tree._told.discard(defaultdict)
    state = {"labels": frozenset({"a", "b"}), "seen": {1, 2}, "counts": defaultdict(int, {"x": 2})}
    with caplog.at_level("WARNING", logger="fastckpt"):
        fastckpt.save(encode(state), tmp_path / "ck")
    back = decode(fastckpt.load(tmp_path / "ck"))
    assert type(back["labels"]) is frozenset and back["labels"] == {"a", "b"}
    assert type(back["seen"]) is set and back["seen"] == {1, 2}
    assert back["counts"] == {"x": 2}
    said = [r.getMessage() for r in caplog.records if "defaultdict" in r.getMessage()]
    assert said and "'/counts'" in said[0] and "plain dict" in said[0], said
    tree._told.discard(defaultdict)  # (the integration conftest checks no save of a framework warns)


def test_consolidate_refuses_a_model_parallel_tag_naming_it(tmp_path):
    """A pipeline-parallel tag (files of mp_rank_00 and mp_rank_01) was refused as 'ZeRO-1 of 1 ranks but
    the tag holds the optimizer files ...': an incomplete tag, which it is not (a DeepSpeed differential
    probe). It is named as model/pipeline parallel, which consolidation does not merge."""
    from fastckpt.errors import ShardedCheckpointError
    from fastckpt.loading.zero import consolidate, find_zero_tag
    run = _zero_tag(tmp_path, 1, {"a": torch.ones(6)})
    tag = run / "step1"
    names = [n for n in os.listdir(tag) if n.endswith(".pt")]
    ce = FastCkptCheckpointEngine()
    for n in names:  # the same files again for model-parallel rank 1
        ce.save(ce.load(str(tag / n)), str(tag / n.replace("mp_rank_00", "mp_rank_01")))
    ce.commit(None)
    with pytest.raises(ShardedCheckpointError, match="mp_rank_00, 01"):
        consolidate(find_zero_tag(str(run)))
