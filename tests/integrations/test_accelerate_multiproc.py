"""accelerate plugin with 2 CPU processes (``accelerate launch --num_processes 2 --cpu``, gloo DDP).

Run 1 trains a tiny Llama for 3 epochs (per-rank seeds, dropout on, shuffled data), saves through
fastckpt after epoch 0 (sync, ``checkpoint_0``) and epoch 1 (async, ``checkpoint_1``) and records
each rank's losses. Run 2 is a fresh 2-process job: it first diverges, then ``load_state()``
(newest committed = ``checkpoint_1``) and trains epoch 2; then ``load_state(checkpoint_0)`` and
trains epochs 1-2. Every rank's losses and the final weights must equal run 1's bit for bit;
each save must leave exactly one committed folder, written once (rank 0), loadable by
``fastckpt.load``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("accelerate")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import fastckpt  # noqa: E402

WORKER = textwrap.dedent(r'''
    import hashlib, json, os, sys
    from pathlib import Path
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    sys.path.insert(0, os.environ["FASTCKPT_REPO"])
    # this checkout's plugin (an installed fastckpt.integrations may point at another tree)
    from integrations.accelerate import plugin as fca
    from integrations.hf.models import tiny_llama
    assert Path(fca.__file__).resolve().parents[2] == Path(os.environ["FASTCKPT_REPO"]).resolve()  # integrations/accelerate/plugin.py

    mode, proj, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    EPOCHS = 3
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(proj), automatic_checkpoint_naming=True))
    set_seed(7, device_specific=True)  # every rank has its own RNG stream (dropout differs)
    assert acc.num_processes == 2, acc.num_processes
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = [(torch.arange(8) * (i + 3)) % 128 for i in range(16)]
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)  # 4 steps/epoch/rank
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    plugin = fca.enable(acc)

    def epoch(e):
        losses = []
        for x in dl:
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
            losses.append(loss.item())
        return losses

    def digest():
        h = hashlib.sha256()
        for k, v in sorted(acc.unwrap_model(model).state_dict().items()):
            h.update(k.encode()); h.update(v.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    res = {"rank": acc.process_index}
    if mode == "train":
        res["losses"] = []
        for e in range(EPOCHS):
            res["losses"] += epoch(e)
            if e == 0:
                plugin.async_save = False
                res["saved"] = [str(acc.save_state())]
            elif e == 1:
                plugin.async_save = True
                res["saved"].append(str(acc.save_state()))
        plugin.wait()
        res["digest"] = digest()
    else:
        epoch(0)  # diverge: the loads must undo this
        acc.load_state()  # newest committed: checkpoint_1 (after epoch 1)
        res["from_1"] = epoch(2)
        res["digest_1"] = digest()
        acc.load_state(proj / "checkpoints" / "checkpoint_0")
        res["from_0"] = epoch(1) + epoch(2)
        res["digest_0"] = digest()
    acc.wait_for_everyone()
    out.with_name(f"{out.name}.{acc.process_index}").write_text(json.dumps(res))
    acc.end_training()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, script: Path, mode: str, proj: Path) -> list[dict]:
    out = tmp_path / f"{mode}.json"
    env = dict(os.environ, FASTCKPT_REPO=str(REPO), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
           str(script), mode, str(proj), str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=75)
    except subprocess.TimeoutExpired:  # a collective that not every rank joins hangs: kill the job
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{mode}: 2-process job hung (>75 s):\n{stderr[-6000:]}")
    done = [i for i in range(2) if out.with_name(f"{out.name}.{i}").exists()]  # ranks that finished their work
    assert proc.returncode == 0, (f"{mode} failed ({proc.returncode}); ranks with results written: {done}\n"
                                  f"{stdout[-3000:]}\n{stderr[-6000:]}")
    return [json.loads(out.with_name(f"{out.name}.{i}").read_text()) for i in range(2)]


def test_two_process_save_resume_exact(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proj = tmp_path / "run"
    ref = _launch(tmp_path, script, "train", proj)
    ck = proj / "checkpoints"
    # one committed folder per save, nothing else (no temp folders left, no duplicates)
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert ref[0]["saved"] == ref[1]["saved"] == [str(ck / "checkpoint_0"), str(ck / "checkpoint_1")]
    for p in ck.iterdir():
        assert fastckpt.is_committed(p)
        assert not list(p.glob("*.pt")) and not list(p.glob("*.pkl")) and not list(p.glob("*.bin"))
        snap = fastckpt.load(p)
        assert {"model", "optimizers", "schedulers", "rng", "step"} <= set(snap)
        assert len(snap["rng_per_process"]) == 2  # every rank's RNG, written once by rank 0
    assert ref[0]["losses"] != ref[1]["losses"]  # ranks see different data/dropout
    assert ref[0]["digest"] == ref[1]["digest"]  # DDP keeps replicas identical

    # the resuming job must not see run 1's in-flight state: copy only the committed folders
    proj2 = tmp_path / "run2"
    shutil.copytree(ck, proj2 / "checkpoints")
    got = _launch(tmp_path, script, "resume", proj2)
    for r, g in zip(ref, got):
        assert g["from_1"] == r["losses"][8:], g["rank"]
        assert g["from_0"] == r["losses"][4:], g["rank"]
        assert g["digest_1"] == g["digest_0"] == r["digest"], g["rank"]
    assert sorted(p.name for p in (proj2 / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
