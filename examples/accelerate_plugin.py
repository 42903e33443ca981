"""accelerate's ``save_state`` / ``load_state`` through fastckpt: train, stop, resume, same losses.

``enable(accelerator, async_save=True)`` rebinds ``accelerator.save_state`` / ``load_state``: the
model, optimizer, scheduler, RNG states and the dataloader position go into one committed fastckpt
folder per save (automatic ``checkpoint_N`` naming, ``total_limit`` honoured), written in the
background while training goes on.

    python examples/accelerate_plugin.py --dir /tmp/acc-run --stop-at 6
    python examples/accelerate_plugin.py --dir /tmp/acc-run --resume      # steps 7..12
    python examples/accelerate_plugin.py --dir /tmp/acc-ref --stop-at 6 --reference   # accelerate's own
    python examples/accelerate_plugin.py --dir /tmp/acc-ref --resume --reference      # same losses

The resumed losses equal those of accelerate's own save_state/load_state (``--reference``), which
differ from an unbroken run's after the resume point: ``skip_first_batches`` re-seeds the dataloader.

Runs on CPU (one process); under ``accelerate launch`` every rank runs the same calls.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from fastckpt.integrations.accelerate.plugin import enable


class Progress:
    """The global step, checkpointed with the rest through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def main() -> None:
    """Train ``--steps`` steps with a save every ``--save-every``; print ``step N loss L``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="project dir: checkpoints/checkpoint_N folders")
    ap.add_argument("--steps", type=int, default=12, help="total optimizer steps (default 12)")
    ap.add_argument("--save-every", type=int, default=3, help="save_state every N steps (default 3)")
    ap.add_argument("--stop-at", type=int, default=None, help="end the run at this step")
    ap.add_argument("--resume", action="store_true", help="load_state the newest checkpoint first")
    ap.add_argument("--reference", action="store_true",
                    help="accelerate's own save_state/load_state (torch.save files), to compare with")
    args = ap.parse_args()

    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.dir, automatic_checkpoint_naming=True, total_limit=2))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=4, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 16), torch.randn(96, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optim, sched, loader = acc.prepare(model, optim, sched, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)         # saved and loaded with the rest
    if not args.reference:
        enable(acc, async_save=True)

    if args.resume:
        folders = sorted((Path(args.dir) / "checkpoints").glob("checkpoint_*"),
                         key=lambda p: int(p.name.split("_")[1]))
        acc.load_state(str(folders[-1]))             # model, optimizer, scheduler, RNG, progress
        acc.project_configuration.iteration = int(folders[-1].name.split("_")[1]) + 1
        print(f"resumed from {folders[-1].name} at step {progress.step}")
    end = min(args.steps, args.stop_at or args.steps)
    while progress.step < end:
        skip = progress.step % len(loader)           # batches of this epoch already trained on
        for x, y in acc.skip_first_batches(loader, skip) if skip else loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optim.step()
            sched.step()
            optim.zero_grad()
            progress.step += 1
            print(f"step {progress.step} loss {loss.item():.6f}")
            if progress.step % args.save_every == 0:
                acc.save_state()                     # returns once staged (async_save=True)
            if progress.step == end:
                break
    if not args.reference:
        acc.fastckpt.wait()                          # the last save is committed

if __name__ == "__main__":
    main()
