"""verify on run roots and foreign folders; damaged headers are problems (exit 1); manager.load waits."""

import safetensors.torch as st
import torch

import fastckpt
from fastckpt.cli.main import main as cli_main


def test_verify_run_root_takes_newest_committed(tmp_path, capsys):
    mgr = fastckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"model": {"w": torch.arange(6.0)}})
    mgr.save(2, {"model": {"w": torch.arange(7.0)}})
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert "step-2" in capsys.readouterr().out


def test_verify_foreign_file_validates_headers_and_says_so(tmp_path, capsys):
    st.save_file({"a": torch.ones(3)}, str(tmp_path / "x.safetensors"))
    rep = fastckpt.verify(tmp_path / "x.safetensors")
    assert rep.ok and rep.notes and "no checksums" in rep.notes[0]
    assert cli_main(["verify", str(tmp_path / "x.safetensors")]) == 0
    assert "note:" in capsys.readouterr().out


def test_one_file_of_a_checkpoint_is_checked_against_its_folders_manifest(tmp_path, capsys):
    """A shard file of a fastckpt checkpoint is verified against the manifest beside it (its ranges
    only), not waved through as a foreign file with nothing to compare."""
    p = fastckpt.save({"model": {"w": torch.arange(1000.0)}, "opt": {"m": torch.ones(10)}}, tmp_path / "ck")
    shard = p / "model.safetensors"
    rep = fastckpt.verify(shard)
    assert rep.ok and not rep.notes and 4000 <= rep.bytes_checked < 4000 + 8192, rep
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01  # a data byte of model/w
    shard.write_bytes(bytes(raw))
    rep = fastckpt.verify(shard)
    assert not rep.ok and "'model/w'" in rep.problems[0], rep
    assert cli_main(["verify", str(shard)]) == 1
    assert "FAILED (1 problem)" in capsys.readouterr().out
    assert fastckpt.verify(p / "state-00001-of-00001.safetensors").ok  # the other file is intact


def test_a_sub_folder_file_is_checked_against_the_checkpoints_manifest(tmp_path, capsys):
    """peft's second adapter lies in a sub-folder (``CKPT/second/adapter_model.safetensors``, a weights
    stem naming a sub-folder) that ``CKPT/manifest.json`` lists: verify of that file or of the sub-folder
    said 'no manifest.json, no checksums to compare', exit 0, over a flipped byte."""
    p = fastckpt.save({"model": {"w": torch.arange(100.0)}, "ad": {"a.weight": torch.arange(500.0)}}, tmp_path / "ck",
                      weights={"model": "model", "ad": "second/adapter_model"})
    f = p / "second" / "adapter_model.safetensors"
    for target in (f, p / "second"):
        rep = fastckpt.verify(target)
        assert rep.ok and not rep.notes and 2000 <= rep.bytes_checked < 2000 + 8192, (target, rep)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01
    f.write_bytes(bytes(raw))
    for target in (f, p / "second"):
        assert cli_main(["verify", str(target), "-q"]) == 1, target
        assert "'ad/a.weight'" in capsys.readouterr().out, target
    assert fastckpt.verify(p / "model.safetensors").ok


def test_flip_in_header_is_a_named_problem_exit_1(tmp_path, capsys):
    p = fastckpt.save({"model": {"w": torch.arange(64.0)}}, tmp_path / "ck")
    shard = p / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[20] ^= 0x01
    shard.write_bytes(bytes(raw))
    rep = fastckpt.verify(p)
    assert not rep.ok and str(shard) in rep.problems[0]
    assert cli_main(["verify", str(p)]) == 1
    assert "FAILED (" in capsys.readouterr().out


def test_a_damaged_header_does_not_hide_damage_in_other_files(tmp_path):
    p = fastckpt.save({"model": {"w": torch.arange(64.0)}, "opt": {"m": torch.arange(32.0)}}, tmp_path / "ck")
    state_shard = p / "state-00001-of-00001.safetensors"
    model_shard = p / "model.safetensors"
    for f, pos in ((state_shard, 20), (model_shard, 4096 + 8)):  # header of one, data of the other
        raw = bytearray(f.read_bytes())
        raw[pos] ^= 0x01
        f.write_bytes(bytes(raw))
    rep = fastckpt.verify(p)
    assert any(str(state_shard) in x for x in rep.problems), rep.problems
    assert any("tensor 'model/w'" in x for x in rep.problems), rep.problems


def test_bad_usage_is_a_clean_error_not_a_traceback(tmp_path, capsys):
    assert cli_main(["prune", str(tmp_path), "--keep", "0"]) == 2
    assert "keep must be >= 1" in capsys.readouterr().err


def test_manager_load_waits_for_its_pending_save(tmp_path):
    mgr = fastckpt.CheckpointManager(tmp_path)
    big = {"model": {"w": torch.randn(2048, 2048)}}
    mgr.async_save(300, big)
    out = mgr.load()  # must not race the background commit
    assert torch.equal(out["model"]["w"], big["model"]["w"])


def test_prefix_on_one_checkpoint_is_said_not_ignored(tmp_path, capsys):
    """`fastckpt verify CKPT --prefix x` ignored --prefix silently (a README-only trial); it verifies the
    checkpoint and says that --prefix selects checkpoints of a run root."""
    ck = fastckpt.save({"w": torch.ones(3)}, tmp_path / "step-1")
    assert cli_main(["verify", str(ck), "--prefix", "epoch", "-q"]) == 0
    out = capsys.readouterr()
    assert "OK" in out.out and "--prefix epoch selects checkpoints of a run root" in out.err, out
