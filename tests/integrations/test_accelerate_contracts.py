"""accelerate plugin keeps accelerate 1.15.0's contracts (issue 14), with the real accelerate on CPU.

Pre-hooks, stateful dataloader mid-epoch resume, strict load / map_location / load_kwargs,
numbering after load_state (+ total_limit, ValueError types), per-accelerator failures, and a
pending save at interpreter exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.accelerate import plugin as fca
except ImportError:
    sys.path.insert(0, str(REPO))
    from integrations.accelerate import plugin as fca

import fastckpt
from fastckpt.errors import (AccelerateCheckpointNotFoundError, AccelerateStateError, ChecksumMismatchError,
                             StateDictMismatchError)

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed  # noqa: E402
from test_accelerate import Counter  # noqa: E402  (a registered custom object with state)


@pytest.fixture(autouse=True)
def fresh_state():
    """accelerate's AccelerateTestCase.tearDown: every test starts from a clean singleton state."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Net(torch.nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
        if extra:
            self.c = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make(project_dir=None, *, total_limit=None, async_save=False, stateful=False, extra=False, n=64,
         save_on_each_node=False, seed=0, shuffle=True, opt_on_extra=True):
    set_seed(seed)
    cfg = ProjectConfiguration(project_dir=str(project_dir) if project_dir else None,
                               automatic_checkpoint_naming=project_dir is not None, total_limit=total_limit,
                               save_on_each_node=save_on_each_node)
    acc = Accelerator(cpu=True, project_config=cfg,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    model = Net(extra)
    params = model.parameters() if opt_on_extra else [*model.a.parameters(), *model.b.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ds = torch.utils.data.TensorDataset(torch.arange(n * 2, dtype=torch.float32).view(n * 2, 1).repeat(1, 4))
    dl = torch.utils.data.DataLoader(ds, batch_size=2, shuffle=shuffle)
    model, opt, dl = acc.prepare(model, opt, dl)
    plugin = fca.enable(acc, async_save=async_save)
    return acc, model, opt, dl, plugin


def train_step(acc, model, opt, x):
    loss = model(x).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def weights(acc, model):
    return {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}


# -- pre-hooks --------------------------------------------------------------------------------------
def test_pre_hooks_run_and_their_files_commit_with_the_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    acc, model, opt, dl, plugin = make()
    train_step(acc, model, opt, torch.ones(2, 4))
    seen = {}

    def save_hook(models, weights_, output_dir):  # diffusers/peft style: save the model our way
        seen["save"] = (len(models), len(weights_), output_dir)
        save_file(weights_.pop(), os.path.join(output_dir, "my_weights.safetensors"))
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump({"class_name": type(models[0]).__name__}, f)

    def load_hook(models, input_dir):
        seen["load"] = input_dir
        m = models.pop()
        m.load_state_dict(load_file(os.path.join(input_dir, "my_weights.safetensors")))
        with open(os.path.join(input_dir, "data.json")) as f:
            m.class_name = json.load(f)["class_name"]

    h1 = acc.register_save_state_pre_hook(save_hook)
    h2 = acc.register_load_state_pre_hook(load_hook)
    ref = weights(acc, model)
    out = Path(acc.save_state(tmp_path / "ck"))
    assert seen["save"][:2] == (1, 1) and Path(seen["save"][2]).name == "ck"
    assert fastckpt.is_committed(out)
    names = set(os.listdir(out))
    assert {"my_weights.safetensors", "data.json"} <= names
    assert not any(n.startswith("model") for n in names)  # the hook took the model out of `weights`
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"my_weights.safetensors", "data.json"} <= set(manifest["files"])
    assert not any(k.startswith("model/") for k in manifest["tensors"])

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(out)
    assert seen["load"] == str(out)
    assert model.class_name == "Net"
    for k, v in weights(acc, model).items():
        assert torch.equal(v, ref[k]), k

    h1.remove()
    h2.remove()
    out2 = Path(acc.save_state(tmp_path / "ck2"))  # hooks removed: the plugin saves the model again
    assert "data.json" not in os.listdir(out2) and any(n.startswith("model") for n in os.listdir(out2))


def test_pre_hook_writing_a_subfolder_is_refused_before_anything_is_written(tmp_path):
    acc, model, opt, dl, plugin = make()

    def save_hook(models, weights_, output_dir):
        os.makedirs(os.path.join(output_dir, "unet"))

    acc.register_save_state_pre_hook(save_hook)
    with pytest.raises(AccelerateStateError, match="unet"):
        acc.save_state(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    assert acc.project_configuration.iteration == 0


def test_pre_hook_file_named_like_the_checkpoints_weights_is_refused(tmp_path):
    acc, model, opt, dl, plugin = make()

    def save_hook(models, weights_, output_dir):  # keeps the model in `weights` and writes its name
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as f:
            f.write(b"x")

    acc.register_save_state_pre_hook(save_hook)
    with pytest.raises(AccelerateStateError, match="model.safetensors"):
        acc.save_state(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# -- stateful dataloader ------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save,shuffle", [(False, True), (True, True), (False, False)])
def test_stateful_dataloader_resumes_mid_epoch(tmp_path, async_save, shuffle):
    acc, model, opt, dl, plugin = make(stateful=True, async_save=async_save, shuffle=shuffle)
    it = iter(dl)
    for _ in range(3):
        train_step(acc, model, opt, next(it)[0])
    acc.save_state(tmp_path / "ck")
    rest = [b[0].clone() for b in it]
    assert len(rest) == 61

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, model2, opt2, dl2, _ = make(stateful=True, seed=1, shuffle=shuffle)  # another seed: no luck
    acc2.load_state(tmp_path / "ck")
    got = [b[0].clone() for b in dl2]
    assert len(got) == 61  # not the 64 of a whole epoch
    assert all(torch.equal(a, b) for a, b in zip(got, rest))  # the same batches, in the same order


# -- strict load, map_location, load_kwargs ------------------------------------------------------------
def test_strict_load_refuses_mismatched_keys_and_changes_nothing(tmp_path):
    acc, model, opt, dl, plugin = make()
    out = acc.save_state(tmp_path / "ck")
    AcceleratorState._reset_state(True)
    acc2, model2, opt2, dl2, _ = make(extra=True, seed=3)
    before = weights(acc2, model2)
    with pytest.raises(StateDictMismatchError) as ei:
        acc2.load_state(out)
    assert isinstance(ei.value, RuntimeError)  # accelerate's (torch's) type
    assert ei.value.missing == ["c.weight", "c.bias"] and ei.value.unexpected == []
    assert "c.weight" in str(ei.value) and "strict=False" in str(ei.value)
    for k, v in weights(acc2, model2).items():
        assert torch.equal(v, before[k]), k  # nothing loaded
    with pytest.raises(AccelerateStateError, match="parameter groups"):  # its optimizer has 6 params, not 4
        acc2.load_state(out, strict=False)
    for k, v in weights(acc2, model2).items():
        assert torch.equal(v, before[k]), k  # refused before the model was touched

    AcceleratorState._reset_state(True)
    acc3, model3, opt3, dl3, _ = make(extra=True, seed=3, opt_on_extra=False)
    acc3.load_state(out, strict=False)  # accelerate's escape hatch: the matching keys load
    ref = weights(acc, model)
    got = weights(acc3, model3)
    assert all(torch.equal(got[k], ref[k]) for k in ref) and torch.equal(got["c.weight"], before["c.weight"])


def test_map_location_and_load_kwargs_are_honoured(tmp_path):
    acc, model, opt, dl, plugin = make()
    train_step(acc, model, opt, torch.ones(2, 4))
    out = Path(acc.save_state(tmp_path / "ck"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location"):
        acc.load_state(out, map_location="invalid")
    acc.load_state(out, map_location="cpu")
    acc.load_state(out, map_location="on_device")
    with pytest.raises(TypeError, match="nope"):
        acc.load_state(out, load_kwargs={"nope": 1})
    acc.load_state(out, load_kwargs={"weights_only": True})
    # flip one byte of the model's weights: the resume checks the checksums by default (issue 20);
    # verify=False (a fastckpt.load option) skips the check
    shard = next(p for p in sorted(out.iterdir()) if p.name.startswith("model") and p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        acc.load_state(out)
    with pytest.raises(ChecksumMismatchError):
        acc.load_state(out, load_kwargs={"verify": True})
    acc.load_state(out, load_kwargs={"verify": False})  # without verify the changed byte is read as is


# -- numbering, total_limit, ValueError --------------------------------------------------------------
def test_numbering_continues_after_load_state(tmp_path):
    acc, model, opt, dl, plugin = make(tmp_path, total_limit=2)
    for _ in range(3):
        acc.save_state()
    ck = tmp_path / "checkpoints"
    assert sorted(os.listdir(ck)) == ["checkpoint_1", "checkpoint_2"]

    AcceleratorState._reset_state(True)
    acc2, model2, opt2, dl2, _ = make(tmp_path, total_limit=2)  # a restarted run: iteration 0
    acc2.load_state()
    assert acc2.project_configuration.iteration == 3
    assert acc2.save_state() == ck / "checkpoint_3"
    assert sorted(os.listdir(ck)) == ["checkpoint_2", "checkpoint_3"]  # the new save is kept

    acc2.project_configuration.iteration = 2  # accelerate refuses an existing folder with ValueError
    with pytest.raises(ValueError, match="checkpoint_2") as ei:
        acc2.save_state()
    assert isinstance(ei.value, AccelerateStateError) and acc2.project_configuration.iteration == 2
    assert fastckpt.is_committed(ck / "checkpoint_2")
    with pytest.raises(ValueError, match="does not exist") as ei:
        acc2.load_state(tmp_path / "nope")
    assert isinstance(ei.value, AccelerateCheckpointNotFoundError)


def test_total_limit_never_deletes_the_save_just_made(tmp_path):
    acc, model, opt, dl, plugin = make(tmp_path, total_limit=1)
    acc.project_configuration.iteration = 9
    acc.save_state()  # an earlier run's checkpoint_9
    acc.project_configuration.iteration = 3
    out = acc.save_state()
    assert fastckpt.is_committed(out)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_3", "checkpoint_9"]


@pytest.mark.parametrize("async_save", [False, True])
def test_register_for_checkpointing_and_save_on_each_node(tmp_path, async_save):
    acc, model, opt, dl, plugin = make(tmp_path, total_limit=2, async_save=async_save, save_on_each_node=True)
    c = Counter()
    acc.register_for_checkpointing(c)
    for i in range(4):
        c.n = i
        acc.save_state()
    plugin.wait()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    acc.load_state()
    assert c.n == 3
    acc.load_state(tmp_path / "checkpoints" / "checkpoint_2")
    assert c.n == 2


# -- one saver per accelerator ---------------------------------------------------------------------------
def test_failed_async_save_surfaces_only_in_its_own_accelerator(tmp_path, monkeypatch):
    import fastckpt.saving.saver as saver_mod

    real = saver_mod.commit_single

    class DiskGone(OSError):
        pass

    def failing(sv, report):
        if "run_a" in str(sv.path):
            raise DiskGone(5, "injected I/O error", str(sv.path))
        return real(sv, report)

    monkeypatch.setattr(saver_mod, "commit_single", failing)
    acc_a, model_a, opt_a, _, plugin_a = make(tmp_path / "run_a", async_save=True)
    acc_b, model_b, opt_b, _, plugin_b = make(tmp_path / "run_b", async_save=True)
    acc_a.save_state()  # fails in the background
    acc_b.save_state()
    acc_b.save_state()
    acc_b.load_state()  # B never sees A's failure
    plugin_b.wait()
    assert fastckpt.is_committed(tmp_path / "run_b" / "checkpoints" / "checkpoint_1")
    with pytest.raises(DiskGone):
        acc_a.save_state()  # A's own next call raises A's error, original type
    assert not (tmp_path / "run_a" / "checkpoints" / "checkpoint_0").exists()


def _exit_at_once():
    pass


def test_forked_dataloader_workers_do_not_wait_for_the_parents_pending_save(tmp_path, monkeypatch):
    """A DataLoader worker forked while an async save is pending must exit at once: the save's
    writer thread lives in the parent only (it used to block each worker's exit until the
    DataLoader killed it, ~5 s per epoch)."""
    import multiprocessing
    import time

    import fastckpt.saving.saver as saver_mod

    real = saver_mod.commit_single

    def slow(sv, report):
        time.sleep(5)
        return real(sv, report)

    monkeypatch.setattr(saver_mod, "commit_single", slow)
    acc, model, opt, dl, plugin = make(tmp_path, async_save=True)
    out = Path(acc.save_state())
    child = multiprocessing.get_context("fork").Process(target=_exit_at_once)
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert not fastckpt.is_committed(out)  # the parent's save was pending all along
    plugin.wait()
    assert fastckpt.is_committed(out)


# -- pending save at interpreter exit -------------------------------------------------------------------
EXIT_SCRIPT = textwrap.dedent(r'''
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    try:
        from fastckpt.integrations.accelerate import plugin as fca
    except ImportError:
        from integrations.accelerate import plugin as fca
    if sys.argv[2] == "fail":
        import fastckpt.saving.saver as saver_mod
        def failing(sv, report):
            raise OSError(28, "injected: no space left on device")
        saver_mod.commit_single = failing
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(1024, 1024))
    fca.enable(acc, async_save=True)
    acc.save_state()
    print("returned", flush=True)
    # exits without wait()
''')


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_exit_with_a_pending_save_is_never_silent(tmp_path, outcome):
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "proj"), outcome, str(REPO)],
                          capture_output=True, text=True, timeout=240)
    assert "returned" in proc.stdout, proc.stderr
    ck = tmp_path / "proj" / "checkpoints" / "checkpoint_0"
    if outcome == "ok":
        assert proc.returncode == 0, proc.stderr
        assert fastckpt.is_committed(ck)
        w = fastckpt.load(ck)["model"]["weight"]
        assert w.shape == (1024, 1024)
    else:
        assert proc.returncode != 0
        assert "FAILED" in proc.stderr and "no space left" in proc.stderr
        assert not ck.exists()
