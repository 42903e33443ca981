"""accelerate plugin: save_state/load_state through fastckpt, automatic naming, exact resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
try:
    from fastckpt.integrations.accelerate import plugin as fca
    from fastckpt.integrations.hf.models import tiny_llama
except ImportError:
    sys.path.insert(0, str(REPO))
    from integrations.accelerate import plugin as fca
    from integrations.hf.models import tiny_llama

import fastckpt

accelerate = pytest.importorskip("accelerate")


class Counter:
    """A registered custom object with state."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def setup(project_dir, total_limit=None, async_save=False):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    set_seed(7)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit))
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = [torch.randint(0, 128, (8,)) for _ in range(32)]
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    plugin = fca.enable(acc, async_save=async_save)
    return acc, model, opt, sched, dl, counter, plugin


def step(acc, model, opt, sched, x, counter):
    out = model(input_ids=x, labels=x)  # dropout on: consumes torch RNG
    acc.backward(out.loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.n += 1
    return out.loss.item()


def run(acc, model, opt, sched, dl, counter, n):
    losses = []
    for x in dl:
        if len(losses) == n:
            break
        losses.append(step(acc, model, opt, sched, x, counter))
    return losses


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_exact_and_naming(tmp_path, async_save):
    acc, model, opt, sched, dl, counter, plugin = setup(tmp_path, total_limit=2, async_save=async_save)
    run(acc, model, opt, sched, dl, counter, 3)
    for _ in range(3):
        acc.save_state()
    plugin.wait()
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # total_limit
    assert all(fastckpt.is_committed(p) for p in ck.iterdir())
    assert not list(ck.glob("**/*.pt")) and not list(ck.glob("**/*.bin")) and not list(ck.glob("**/*.pkl"))
    # the reference continues; a second accelerator restores and must produce identical losses
    x = (torch.arange(32).view(4, 8) * 5) % 128  # fixed batch: no RNG drawn after the save
    ref = [step(acc, model, opt, sched, x, counter) for _ in range(3)]
    ref_w = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    acc2, model2, opt2, sched2, dl2, counter2, _ = setup(tmp_path)
    acc2.project_configuration.iteration = 3
    step(acc2, model2, opt2, sched2, x, counter2)  # diverge first, load must undo it
    acc2.load_state()
    assert counter2.n == 3 and sched2.scheduler.last_epoch == sched.scheduler.last_epoch - 3
    got = [step(acc2, model2, opt2, sched2, x, counter2) for _ in range(3)]
    assert got == ref
    for k, v in acc2.unwrap_model(model2).state_dict().items():
        assert torch.equal(v, ref_w[k]), k


def test_load_skips_uncommitted_and_save_failure_surfaces(tmp_path, monkeypatch):
    acc, model, opt, sched, dl, counter, plugin = setup(tmp_path)
    run(acc, model, opt, sched, dl, counter, 1)
    acc.save_state()
    bad = tmp_path / "checkpoints" / "checkpoint_9"  # crashed plain save: no manifest
    bad.mkdir()
    assert plugin.latest() == tmp_path / "checkpoints" / "checkpoint_0"
    acc.load_state()  # picks checkpoint_0
    assert counter.n == 1

    class Boom(OSError):
        pass

    def failing(*a, **k):
        raise Boom(28, "no space left")

    monkeypatch.setattr(fastckpt.Saver, "async_save", failing)  # the plugin saves through its own Saver
    with pytest.raises(Boom):
        acc.save_state()
    assert not (tmp_path / "checkpoints" / "checkpoint_1").exists()


def test_requires_dir_without_auto_naming(tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    fca.enable(acc)
    with pytest.raises(ValueError):
        acc.save_state()
    acc.save_state(tmp_path / "x")
    assert fastckpt.is_committed(tmp_path / "x")


def test_the_torch_optimizer_is_found_inside_accelerates_wrapper_while_accumulating():
    """AcceleratedOptimizer subclasses torch.optim.Optimizer, and its step() does nothing while
    gradients accumulate: torch's get_state_dict, which initialises a fresh optimizer by calling
    step(), got the wrapper and left the state empty, so an FSDP2 load_state mid-accumulation into a
    never-stepped optimizer was refused (a multi-rank probe; accelerate's own load leaves it empty)."""
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from integrations.hf.rank_state import torch_optimizer
    acc = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model, wrapped = acc.prepare(model, opt)
    acc.gradient_state._set_sync_gradients(False)  # mid-accumulation
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and torch_optimizer(wrapped) is opt
    assert len(get_optimizer_state_dict(model, torch_optimizer(wrapped))["state"]) == 2
    assert torch_optimizer(None) is None and torch_optimizer(opt) is opt


def test_save_state_returns_a_path_as_accelerate_does(tmp_path):
    """accelerate's save_state returns a pathlib.Path; the plugin returned a str, so
    `acc.save_state(d) / "meta.json"` raised TypeError (an accelerate differential probe)."""
    acc, model, opt, sched, dl, counter, plugin = setup(tmp_path)
    got = acc.save_state()
    assert isinstance(got, Path) and got == tmp_path / "checkpoints" / "checkpoint_0" and fastckpt.is_committed(got)


def test_a_newer_checkpoint_by_accelerate_alone_is_refused_not_skipped(tmp_path):
    """checkpoints/ with the plugin's checkpoint_0 and a newer checkpoint_1 by accelerate's own
    save_state (before the plugin was enabled): accelerate resumes from checkpoint_1, the plugin
    resumed silently from checkpoint_0 (an accelerate differential probe)."""
    from fastckpt.errors import AccelerateCheckpointNotFoundError
    acc, model, opt, sched, dl, counter, plugin = setup(tmp_path)
    acc.save_state()
    theirs = tmp_path / "checkpoints" / "checkpoint_1"
    theirs.mkdir()
    (theirs / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    (theirs / "optimizer.bin").write_bytes(b"x")
    with pytest.raises(AccelerateCheckpointNotFoundError, match=r"checkpoint_1 is the newest checkpoint and was written by accelerate's own"):
        acc.load_state()
    acc.load_state(tmp_path / "checkpoints" / "checkpoint_0")  # asked for by name: fine


def test_a_modules_extra_state_round_trips(tmp_path):
    """A module's non-tensor get_extra_state() (quantization / Transformer Engine modules) made the save
    fail with AttributeError: 'dict' object has no attribute 'numel' (dedup_tied; an accelerate
    differential probe). It is saved in state.json and handed back to set_extra_state."""
    from accelerate import Accelerator

    class Calibrated(torch.nn.Linear):
        def get_extra_state(self):
            return {"calib": 3, "scale": 0.5}

        def set_extra_state(self, s):
            self.got = s

    acc = Accelerator(cpu=True)
    acc.prepare(Calibrated(2, 2))
    fca.enable(acc)
    out = acc.save_state(tmp_path / "c")
    acc2 = Accelerator(cpu=True)
    m2 = acc2.prepare(Calibrated(2, 2))
    fca.enable(acc2)
    acc2.load_state(out)
    assert m2.got == {"calib": 3, "scale": 0.5}
