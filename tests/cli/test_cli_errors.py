"""``fastckpt`` CLI errors and layouts: every checkpoint layout this project writes is found
without ``--prefix``; nothing found says where and what was looked for; ``prune`` of a missing or
foreign folder exits non-zero and writes nothing; ``--version``; one unit system for sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.cli.common import human_bytes
from fastckpt.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.accelerate import plugin as fca
except ImportError:  # pyproject mapping not installed: import from the source tree
    sys.path.insert(0, str(REPO))
    from integrations.accelerate import plugin as fca

PATTERNS = ("step-N", "checkpoint-N", "checkpoint_N")


def state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "step": int(v)}


def accelerate_project(project: Path, saves: int = 2) -> Path:
    """``saves`` checkpoints written by our accelerate plugin (``project/checkpoints/checkpoint_N``)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import ProjectConfiguration

    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(4, 2))
    fca.enable(acc)
    for _ in range(saves):
        acc.save_state()
    return project / "checkpoints"


def steps_listed(out: str) -> list[int]:
    return [int(ln.split()[0]) for ln in out.splitlines() if ln.strip()[:1].isdigit()]


def test_ls_verify_prune_find_the_accelerate_plugins_checkpoints(tmp_path, capsys):
    ckpts = accelerate_project(tmp_path / "proj")
    assert sorted(os.listdir(ckpts)) == ["checkpoint_0", "checkpoint_1"]
    for root in (tmp_path / "proj", ckpts):  # project_dir itself, and its checkpoints folder
        assert main(["ls", str(root)]) == 0
        out = capsys.readouterr().out
        assert steps_listed(out) == [0, 1] and "latest committed: 1" in out
        assert str(ckpts / "checkpoint_1") in out
        assert main(["verify", str(root)]) == 0
        out = capsys.readouterr().out
        assert f"newest committed checkpoint {ckpts / 'checkpoint_1'}" in out and ": OK," in out
    assert main(["prune", str(tmp_path / "proj"), "--keep", "1"]) == 0
    assert "removed steps: [0]" in capsys.readouterr().out
    assert sorted(n for n in os.listdir(ckpts) if not n.startswith(".")) == ["checkpoint_1"]


@pytest.mark.parametrize("prefix", ["step-", "checkpoint-", "checkpoint_"])
def test_every_prefix_found_without_prefix_option(tmp_path, capsys, prefix):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, prefix=prefix)
    for s in (3, 7):
        mgr.save(s, state(s))
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert steps_listed(out) == [3, 7] and f"{root / prefix}N" in out
    assert main(["verify", str(root)]) == 0
    assert f"newest committed checkpoint {root / f'{prefix}7'}" in capsys.readouterr().out
    assert main(["prune", str(root), "--keep", "1"]) == 0
    assert mgr.steps() == [7]


def test_trainer_layout_checkpoint_dash_n(tmp_path, capsys):
    """``checkpoint-N`` as the Trainer callback names it (a Trainer output_dir also holds other files)."""
    out_dir = tmp_path / "out"
    for s in (4, 8):
        fastckpt.save(state(s), out_dir / f"checkpoint-{s}")
    (out_dir / "runs").mkdir()  # TensorBoard logs beside the checkpoints
    assert main(["ls", str(out_dir)]) == 0
    assert steps_listed(capsys.readouterr().out) == [4, 8]
    assert main(["verify", str(out_dir)]) == 0
    assert str(out_dir / "checkpoint-8") in capsys.readouterr().out


def test_nothing_found_says_what_and_where(tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    assert main(["ls", str(plain)]) == 2
    io = capsys.readouterr()
    out = io.err
    assert io.out == "" and out.startswith("fastckpt ls: error: ")
    for pat in PATTERNS:
        assert pat in out
    assert str(plain) in out and str(plain / "checkpoints") in out and "no checkpoints" in out
    assert main(["verify", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "nothing to load" not in err
    assert all(p in err for p in PATTERNS) and str(plain) in err
    assert main(["ls", str(plain), "--prefix", "ckpt-"]) == 2
    assert "ckpt-N" in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_uncommitted_only_run_root_says_what_was_skipped(tmp_path, capsys):
    root = tmp_path / "run"
    (root / "step-5").mkdir(parents=True)  # a step folder without a manifest: never committed
    assert main(["verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint" in err and "step-5" in err


def test_prune_missing_root_exits_nonzero(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["prune", str(missing), "--keep", "2"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such file or folder" in err and "nothing pruned" in err
    assert not missing.exists()
    p = subprocess.run([sys.executable, "-m", "fastckpt.cli.main", "prune", "/nonexistent-h5", "--keep", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "/nonexistent-h5" in p.stderr, (p.stdout, p.stderr)


def test_prune_of_a_non_checkpoint_folder_leaves_nothing(tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.bin").write_bytes(b"123")
    before = sorted(os.listdir(plain))
    assert main(["prune", str(plain), "--keep", "2"]) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in PATTERNS) and "nothing pruned" in err
    assert sorted(os.listdir(plain)) == before  # no lock file, nothing else
    assert not (plain / "checkpoints").exists()


def test_prune_refuses_to_guess_between_runs(tmp_path, capsys):
    root = tmp_path / "run"
    CheckpointManager(root, prefix="step-").save(1, state(1))
    CheckpointManager(root, prefix="checkpoint-").save(2, state(2))
    assert main(["ls", str(root)]) == 0
    assert steps_listed(capsys.readouterr().out) == [1, 2]  # both listed
    assert main(["prune", str(root), "--keep", "1"]) == 2
    err = capsys.readouterr().err
    assert "several runs" in err and "step-N" in err and "checkpoint-N" in err
    assert main(["prune", str(root), "--keep", "1", "--prefix", "checkpoint-"]) == 0
    assert (root / "step-1").is_dir() and (root / "checkpoint-2").is_dir()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastckpt {fastckpt.__version__}"
    p = subprocess.run(["fastckpt", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"fastckpt {fastckpt.__version__}"


def test_sizes_in_one_unit_system(tmp_path, capsys):
    assert [human_bytes(n) for n in (512, 1500, 553_300_000, 2 * 10**9)] == ["512 B", "1.5 kB", "553.3 MB",
                                                                             "2.0 GB"]
    root = tmp_path / "run"
    CheckpointManager(root).save(1, {"w": torch.zeros(500_000)})  # 2 MB of tensor data
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b2\.0 MB\b", out) and "MiB" not in out and "KiB" not in out
    assert main(["verify", str(root)]) == 0
    assert re.search(r"2\.0 MB checked", capsys.readouterr().out)
    helps = build_parser().format_help() + build_parser()._subparsers._group_actions[0].choices["ls"].format_help()
    assert "decimal" in helps and "10^6" in helps


def test_closed_pipe_is_not_reported_as_an_error(tmp_path):
    """`fastckpt ls ROOT | head -1`: the reader leaves before the output is written. The command exits
    141 (128 + SIGPIPE, as a shell tool killed by the signal), not 2 ("nothing found") with an error."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in range(1, 4):
        mgr.save(step, {"w": torch.ones(3) * step})
    mgr.close() if hasattr(mgr, "close") else None
    p = subprocess.Popen([sys.executable, "-m", "fastckpt", "ls", str(root)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # before the child has imported anything: its first write gets EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "error" not in err and "Traceback" not in err, err


def test_load_max_shard_size_zero_is_a_usage_error_before_any_work(tmp_path):
    """`fastckpt load SRC --to DIR --max-shard-size 0` passed the parser, started the export, then failed
    with 'max_shard_bytes must be a positive int' (the Python option's name; a README-only trial)."""
    p = subprocess.run([sys.executable, "-m", "fastckpt", "load", str(tmp_path / "src"), "--to", str(tmp_path / "out"),
                        "--max-shard-size", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "argument --max-shard-size: not a positive byte size: '0'" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
