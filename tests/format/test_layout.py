"""File naming of the save plan (fastckpt.format.layout): HF weights named as save_pretrained names them."""

from __future__ import annotations

import pytest

from fastckpt.format.layout import ArraySpec, plan_save, shard_file_names
from fastckpt.storage.model_files import read_header


def _spec(key, group, nbytes=16):
    return ArraySpec(key, key.rsplit("/", 1)[-1], group, "F32", (nbytes // 4,), nbytes)


def _plan(specs, max_shard_bytes=1 << 20, metadata=None):
    return plan_save(specs, max_shard_bytes=max_shard_bytes, chunk_bytes=4096, metadata=metadata)


def test_one_shard_is_stem_safetensors_without_index():
    plan = _plan([_spec("model/a", "model"), _spec("model/b", "model"), _spec("opt/x", "state")])
    assert [f.name for f in plan.files] == ["model.safetensors", "state-00001-of-00001.safetensors"]
    assert "model" not in plan.index  # no model.safetensors.index.json


def test_several_shards_keep_hf_shard_names_and_index():
    plan = _plan([_spec(f"model/w{i}", "model", 64) for i in range(3)], max_shard_bytes=64)
    assert [f.name for f in plan.files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert set(plan.index["model"]) == {"w0", "w1", "w2"}


def test_fastckpt_own_stems_and_peft_base_keep_indexed_names():
    assert shard_file_names("state", 1) == ["state-00001-of-00001.safetensors"]
    assert shard_file_names("rank00003", 1) == ["rank00003-00001-of-00001.safetensors"]
    assert shard_file_names("model", 1) == ["model.safetensors"]
    assert shard_file_names("sub/adapter_model.safetensors", 1) == ["sub/adapter_model.safetensors"]
    # a peft checkpoint (adapter at the top or in a sub-folder): the base stays model-00001-of-00001 + index
    for adapter in ("adapter_model.safetensors", "second/adapter_model.safetensors"):
        plan = _plan([_spec("model/a", "model"), _spec("adapter/x", adapter)])
        assert [f.name for f in plan.files] == ["model-00001-of-00001.safetensors", adapter]
        assert set(plan.index["model"]) == {"a"}


def test_two_stems_writing_one_file_name_are_refused():
    with pytest.raises(ValueError, match="model.safetensors"):
        _plan([_spec("model/a", "model"), _spec("other/b", "model.safetensors")])


def test_weights_files_carry_format_pt_state_files_only_the_given_metadata(tmp_path):
    plan = _plan([_spec("model/a", "model"), _spec("opt/x", "state")], metadata={"run": "1"})
    for f in plan.files:
        (tmp_path / f.name).write_bytes(f.prefix + b"\0" * f.data_bytes)
    assert read_header(str(tmp_path / "model.safetensors")).metadata == {"format": "pt", "run": "1"}
    assert read_header(str(tmp_path / "state-00001-of-00001.safetensors")).metadata == {"run": "1"}


def test_stems_written_by_several_ranks_get_a_file_per_writer():
    from fastckpt.format.layout import SPLIT_MIN_BYTES

    mib8 = 8 << 20
    specs = [_spec(f"model/w{i}", "model", mib8) for i in range(8)]  # 64 MiB of weights
    specs += [_spec(f"opt/s{i}", "state", mib8) for i in range(4)]  # 32 MiB of optimizer state
    specs += [_spec(f"@rank1/x{i}", "rank00001", mib8) for i in range(4)]  # one rank's own: never split
    specs.append(_spec("adapter/a", "adapter_model.safetensors", 3 * mib8))  # one named file: never split
    # (with an adapter beside it, the base keeps indexed names even as one file, as peft lays it out)

    def names(writers, max_shard_bytes=1 << 40):
        plan = plan_save(specs, max_shard_bytes=max_shard_bytes, chunk_bytes=4096, writers=writers)
        return [f.name for f in plan.files], plan

    one, _ = names(1)
    assert one == ["model-00001-of-00001.safetensors", "state-00001-of-00001.safetensors", "rank00001-00001-of-00001.safetensors",
                   "adapter_model.safetensors"]
    two, plan = names(2)
    assert two == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                   "state-00001-of-00002.safetensors", "state-00002-of-00002.safetensors",
                   "rank00001-00001-of-00001.safetensors", "adapter_model.safetensors"]
    assert [f.size - f.data_offset for f in plan.files[:2]] == [32 << 20, 32 << 20]
    # 4 writers: 64 MiB of weights in 4 files of 16 MiB; 32 MiB of state stops at SPLIT_MIN_BYTES per file
    four, plan = names(4)
    assert sum(n.startswith("model-") for n in four) == 4
    assert sum(n.startswith("state-") for n in four) == 32 * MiB // SPLIT_MIN_BYTES == 2
    assert all(f.size - f.data_offset >= SPLIT_MIN_BYTES for f in plan.files if not f.name.startswith("rank"))
    # under 2 x SPLIT_MIN_BYTES a stem is not cut at all (no file under the minimum): 24 MiB, 2 writers
    small_state = [_spec(f"model/s{i}", "model", mib8) for i in range(3)]
    plan = plan_save(small_state, max_shard_bytes=1 << 40, chunk_bytes=4096, writers=2)
    assert [f.name for f in plan.files] == ["model.safetensors"]
    # 40 MiB in 5 tensors, 2 writers: whole tensors, each in the half its middle byte falls in: 16 + 24 MiB
    # (a greedy cut at 20 MiB would leave 16 + 16 + 8, a file under the minimum)
    five = plan_save([_spec(f"model/f{i}", "model", mib8) for i in range(5)], max_shard_bytes=1 << 40,
                     chunk_bytes=4096, writers=2)
    assert sorted(f.size - f.data_offset for f in five.files) == [16 * MiB, 24 * MiB]
    # a smaller max_shard_bytes still wins
    small, _ = names(2, max_shard_bytes=mib8)
    assert sum(n.startswith("model-") for n in small) == 8
    with pytest.raises(ValueError, match="writers"):
        names(0)


MiB = 1 << 20
