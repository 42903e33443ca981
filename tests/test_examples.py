"""The runnable examples/ scripts (one per way in) run as README shows them, under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, nprocs: int = 2) -> str:
    """Runs ``examples/SCRIPT`` under ``torchrun --nproc_per_node NPROCS`` (bounded); returns stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nprocs}", str(ROOT / "examples" / script), *args],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def losses(out: str) -> dict[int, str]:
    """``step N loss L`` lines of an example's output, by step."""
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


def test_fsdp2_torchrun_resume_gives_the_losses_of_an_unbroken_run(tmp_path):
    first = torchrun("fsdp2_torchrun.py", "--dir", str(tmp_path / "a"), "--steps", "3")
    resumed = torchrun("fsdp2_torchrun.py", "--dir", str(tmp_path / "a"), "--steps", "6")
    assert "resumed from" in resumed and "step-3" in resumed
    unbroken = torchrun("fsdp2_torchrun.py", "--dir", str(tmp_path / "b"), "--steps", "6")
    assert sorted(losses(resumed)) == [4, 5, 6]
    assert {**losses(first), **losses(resumed)} == losses(unbroken)


def test_dcp_dropin_round_trip_and_safetensors_reads_it(tmp_path):
    out = torchrun("dcp_dropin.py", "--dir", str(tmp_path / "c"))
    assert "restored 4 model tensors and the optimizer state bit-exactly" in out
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "c" / "model.safetensors"))) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def run(script: str, *args: str) -> str:
    """Runs ``examples/SCRIPT`` as a user would (fastckpt installed; bounded); returns stdout."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def test_trainer_callback_stop_and_resume_gives_the_losses_of_an_unbroken_run(tmp_path):
    stopped = run("trainer_callback.py", "--out", str(tmp_path / "a"), "--stop-at", "6")
    assert sorted(losses(stopped)) == [1, 2, 3, 4, 5, 6]
    resumed = run("trainer_callback.py", "--out", str(tmp_path / "a"), "--resume")
    unbroken = run("trainer_callback.py", "--out", str(tmp_path / "b"))
    assert sorted(losses(unbroken)) == list(range(1, 13))
    assert losses(resumed) == losses(unbroken)
    assert (tmp_path / "a" / "checkpoint-6" / "manifest.json").exists()


def test_accelerate_plugin_resume_gives_the_losses_of_accelerates_own_resume(tmp_path):
    ours = run("accelerate_plugin.py", "--dir", str(tmp_path / "a"), "--stop-at", "6")
    ours_resumed = run("accelerate_plugin.py", "--dir", str(tmp_path / "a"), "--resume")
    ref = run("accelerate_plugin.py", "--dir", str(tmp_path / "r"), "--stop-at", "6", "--reference")
    ref_resumed = run("accelerate_plugin.py", "--dir", str(tmp_path / "r"), "--resume", "--reference")
    assert sorted(losses(ours)) == [1, 2, 3, 4, 5, 6] and sorted(losses(ours_resumed)) == list(range(7, 13))
    assert losses(ours) == losses(ref) and losses(ours_resumed) == losses(ref_resumed)
    assert "resumed from checkpoint_1 at step 6" in ours_resumed
    assert (tmp_path / "a" / "checkpoints" / "checkpoint_3" / "manifest.json").exists()   # fastckpt's folder
    assert not (tmp_path / "r" / "checkpoints" / "checkpoint_3" / "manifest.json").exists()
