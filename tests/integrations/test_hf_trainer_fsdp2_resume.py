"""The HF Trainer under FSDP2 (accelerate's plugin, 2 CPU ranks, forced as a GPU run has it) resumes from
the callback's checkpoint-N: the Trainer's own load_fsdp_model raised on it (it reads only
pytorch_model_fsdp_0/.metadata) before any callback event; the resumed run must log the losses of the
uninterrupted one and end with its weights (a multi-rank probe)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainer_fsdp2_resumes_from_the_callbacks_checkpoint(tmp_path):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1] + 7
    script = Path(__file__).with_name("trainer_fsdp2_cpu.py")
    p = subprocess.run([sys.executable, str(script), str(tmp_path), str(port)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    whole, resumed = res["whole"], res["resumed"]
    assert whole["fsdp"] and whole["dtensor"] and resumed["fsdp"], res  # the real FSDP2 path ran
    assert whole["steps_run"] == 4 and resumed["steps_run"] == 2, res  # it resumed at step 2, not from scratch
    assert resumed["losses"] == whole["losses"] and resumed["sum"] == whole["sum"], res  # steps 3-4 and the weights
