"""FSDP2 training under torchrun, checkpointed by fastckpt, resumed after a stop.

Every rank calls the same ``CheckpointManager.async_save`` with its DTensor state (the sharded model
and AdamW state from ``get_state_dict``) plus its own RNG state under ``local_keys``; a second run
resumes from the newest committed step with ``load_into`` and continues with the same losses it
would have had without the stop.

    torchrun --nproc_per_node 2 examples/fsdp2_torchrun.py --dir /tmp/fsdp2-run --steps 6
    torchrun --nproc_per_node 2 examples/fsdp2_torchrun.py --dir /tmp/fsdp2-run --steps 12   # resumes at 6

Runs on CPU with gloo (any number of ranks that divides the layer width, 64); with GPUs it uses nccl
and one device per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import fastckpt


def build_model() -> torch.nn.Module:
    """A 3-layer MLP of 64 features (fp32), the same on every rank before sharding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def main() -> None:
    """Train ``--steps`` steps, saving every ``--save-every``, resuming from ``--dir`` if it holds one."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="run root: step-N checkpoint folders + `latest`")
    ap.add_argument("--steps", type=int, default=6, help="train until this step (default 6)")
    ap.add_argument("--save-every", type=int, default=3, help="checkpoint every N steps (default 3)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = fastckpt.CheckpointManager(args.dir, keep_last=2)

    start = 0
    if mgr.latest() is not None:
        sd, osd = get_state_dict(model, optim)
        state = mgr.load_into({"model": sd, "optim": osd, "step": 0, "rng": torch.get_rng_state()})
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {mgr.path(start)}")

    pending = None
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, 64)                      # the per-rank RNG stream is part of the checkpoint
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")
        if step % args.save_every == 0:
            if pending is not None:
                pending.result()                     # at most one save in flight
            sd, osd = get_state_dict(model, optim)
            pending = mgr.async_save(step, {"model": sd, "optim": osd, "step": step,
                                            "rng": torch.get_rng_state()}, local_keys=("rng",))
    if pending is not None:
        pending.result()
    mgr.wait()
    if rank == 0:
        print(f"committed steps: {mgr.steps()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
