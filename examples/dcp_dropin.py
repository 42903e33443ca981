"""fastckpt as a drop-in storage layer for ``torch.distributed.checkpoint`` (DCP).

Code that already calls ``dcp.save`` / ``dcp.load`` keeps its calls and planners and swaps only the
storage writer and reader. The folder it writes holds standard safetensors files of full tensors,
so ``safetensors`` (or transformers) reads it with no DCP and no process group.

    torchrun --nproc_per_node 2 examples/dcp_dropin.py --dir /tmp/dcp-ckpt

Runs on CPU with gloo (2 or 4 ranks); with GPUs it uses nccl and one device per rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from fastckpt.dcp import FastCkptReader, FastCkptWriter


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 2-layer MLP (fp32, 64 features) sharded with FSDP2, and its AdamW after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return model, optim


def main() -> None:
    """Save with ``dcp.save`` + FastCkptWriter, load back with ``dcp.load`` + FastCkptReader, compare."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="checkpoint folder to write (replaced if it exists)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()

    model, optim = build()
    sd, osd = get_state_dict(model, optim)
    state = {"model": sd, "optim": osd}
    dcp.save(state, storage_writer=FastCkptWriter(args.dir, overwrite=True))   # DCP's default planner

    fresh, fresh_optim = build()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    sd2, osd2 = get_state_dict(fresh, fresh_optim)
    target = {"model": sd2, "optim": osd2}
    dcp.load(target, storage_reader=FastCkptReader(args.dir))
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), target["model"][k].full_tensor()), k

    if rank == 0:
        from safetensors.torch import load_file
        files = sorted(p.name for p in Path(args.dir).glob("*.safetensors"))
        plain = {}
        for name in files:
            plain.update(load_file(str(Path(args.dir) / name)))
        print(f"dcp.save -> {args.dir}: {files}; dcp.load restored {len(sd)} model tensors and the optimizer "
              f"state bit-exactly; safetensors reads all {len(plain)} tensors (model and optimizer), e.g. "
              f"{sorted(plain)[:2]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
