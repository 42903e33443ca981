"""The ``fastckpt`` command line: ls, verify, prune (in-process, plus one real subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastckpt import CheckpointManager
from fastckpt.cli.main import main, parse_bytes


def make_root(tmp_path, steps=(1, 2, 3)):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for s in steps:
        mgr.save(s, {"model": {"w": torch.full((256,), float(s))}, "opt": {"m": torch.ones(8)}})
    return root, mgr


def flip_byte(ckpt, key):
    e = json.loads((ckpt / "manifest.json").read_text())["tensors"][key]
    with open(ckpt / e["file"], "r+b") as f:
        f.seek(e["offsets"][0] + 3)
        b = f.read(1)
        f.seek(e["offsets"][0] + 3)
        f.write(bytes([b[0] ^ 0x80]))
    return e["file"]


def test_ls(tmp_path, capsys):
    root, mgr = make_root(tmp_path)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(ln.split()[0]) for ln in lines] == [1, 2, 3]
    assert "latest committed: 3" in out and "skipped" not in out
    assert all(str(mgr.path(s)) in out for s in (1, 2, 3))
    assert main(["ls", str(tmp_path / "empty")]) == 2
    io = capsys.readouterr()
    assert io.out == "" and io.err.startswith("fastckpt ls: error: ") and "no checkpoints" in io.err


def test_verify_ok_and_flipped_byte(tmp_path, capsys):
    root, mgr = make_root(tmp_path, steps=(1,))
    ck = mgr.path(1)
    assert main(["verify", str(ck)]) == 0
    assert "OK" in capsys.readouterr().out
    fname = flip_byte(ck, "model/w")
    assert main(["verify", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "'model/w'" in out and fname in out
    assert "'opt/m'" not in out  # only the damaged tensor is named
    assert main(["verify", str(tmp_path / "nope")]) == 2


def test_verify_truncated_and_missing_file(tmp_path, capsys):
    root, mgr = make_root(tmp_path, steps=(1, 2))
    shard = mgr.path(1) / "model.safetensors"
    os.truncate(shard, os.path.getsize(shard) - 10)
    assert main(["verify", str(mgr.path(1))]) == 1
    assert "model.safetensors" in capsys.readouterr().out
    os.unlink(mgr.path(2) / "state.json")
    assert main(["verify", str(mgr.path(2))]) == 1
    assert "state.json" in capsys.readouterr().out


def test_ls_names_a_dcp_folder_among_the_steps_and_prune_leaves_it(tmp_path, capsys):
    """A step-N folder DCP's FileSystemWriter wrote was listed as 'never committed (crashed save or not
    fastckpt)'; it is named as a DCP checkpoint, and prune leaves it alone."""
    import torch.distributed.checkpoint as dcp
    root, mgr = make_root(tmp_path, steps=(2, 3))
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(root / "step-1"), no_dist=True)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "skipped step-1: a torch.distributed.checkpoint (DCP) folder (.metadata)" in out, out
    assert main(["prune", str(root), "--keep", "1"]) == 0
    assert (root / "step-1" / ".metadata").exists() and mgr.steps() == [3]


def test_prune(tmp_path, capsys):
    root, mgr = make_root(tmp_path, steps=(1, 2, 3, 4))
    assert main(["prune", str(root), "--keep", "2"]) == 0
    assert "[1, 2]" in capsys.readouterr().out
    assert mgr.steps() == [3, 4]
    with pytest.raises(SystemExit):
        main(["prune", str(root)])  # --keep is required


def test_parse_bytes():
    assert parse_bytes("4096") == 4096 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("5GB") == 5 * 10**9
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_cli_subprocess_verify_flipped_byte(tmp_path):
    """The installed entry point (``fastckpt``, or ``python -m fastckpt.cli.main``) exits 1 naming file and tensor."""
    root, mgr = make_root(tmp_path, steps=(1,))
    fname = flip_byte(mgr.path(1), "opt/m")
    exe = shutil.which("fastckpt")
    cmd = [exe] if exe else [sys.executable, "-m", "fastckpt.cli.main"]
    p = subprocess.run(cmd + ["verify", str(mgr.path(1))], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "'opt/m'" in p.stdout and fname in p.stdout


def test_ls_names_deepspeed_tags_named_step_n_as_such(tmp_path, capsys):
    """A DeepSpeed save_dir whose tags are named step-N (save_checkpoint(dir, tag=f"step-{n}")) by
    fastckpt's engine: ls called every committed tag "never committed (crashed save or not fastckpt)"
    while verify said OK (a second README-only trial)."""
    import fastckpt
    tag = tmp_path / "step-3"
    fastckpt.save({"module": {"w": torch.ones(2)}}, tag / "mp_rank_00_model_states.pt")
    (tag / "fastckpt_tag.json").write_text("{}")
    (tmp_path / "latest").write_text("step-3")
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-3" in out and "DeepSpeed tag written by fastckpt's engine" in out and "never committed" not in out, out
