"""Rank-side helpers shared by the load_into and DCP reader tests: a tiny fp32 Llama, FSDP2 wrapping,
one AdamW step, the uninterrupted next loss, and a byte-counting I/O backend (imported by name in
spawned rank processes, so it lives in an importable module, not a test module)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import fastckpt
from fastckpt.storage.io import PosixBackend

LR = 1e-2


def llama(seed: int):
    """Tiny fp32 LlamaForCausalLM (hidden 32, 2 layers, vocab 128), weights from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def batches() -> list[torch.Tensor]:
    """Three fixed batches of token ids (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]


def fsdp(model):
    """FSDP2 ``fully_shard`` per decoder layer and at the root, on a fresh 1-D CPU mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model, opt, ids: torch.Tensor) -> float:
    """One training step; returns the loss before it."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def next_loss(model, opt) -> float:
    """The resumed run's check: one more step on batch 1, then the loss on batch 2."""
    b = batches()
    step(model, opt, b[1])
    with torch.no_grad():
        return model(input_ids=b[2], labels=b[2]).loss.item()


class CountingBackend(PosixBackend):
    """Counts the bytes every ``preadv`` returned (thread-safe)."""

    def __init__(self):
        self.bytes = 0
        self.lock = threading.Lock()

    def preadv(self, fd, bufs, offset):
        n = super().preadv(fd, bufs, offset)
        with self.lock:
            self.bytes += max(n, 0)
        return n


def tensor_leaves(state) -> list[torch.Tensor]:
    """Every tensor leaf of a nested state, in order."""
    out = []
    if isinstance(state, dict):
        for v in state.values():
            out += tensor_leaves(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            out += tensor_leaves(v)
    elif isinstance(state, torch.Tensor):
        out.append(state)
    return out


def local_bytes(state) -> int:
    """Bytes of this rank's part of every tensor leaf (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor
    n = 0
    for t in tensor_leaves(state):
        loc = t.to_local() if isinstance(t, DTensor) else t
        n += loc.numel() * loc.element_size()
    return n


def mismatches(got, want, path: str = "") -> list[str]:
    """Key paths where two nested states differ (tensors: dtype, shape and every bit)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, got)) if isinstance(got, dict) else type(got)} != "
                    f"{sorted(map(str, want))}"]
        return [m for k in want for m in mismatches(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path}: {got!r} != {want!r}"]
        return [m for i, (a, b) in enumerate(zip(got, want)) for m in mismatches(a, b, f"{path}/{i}")]
    if isinstance(want, torch.Tensor):
        from torch.distributed.tensor import DTensor
        if isinstance(got, DTensor):
            got = got.full_tensor()
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape \
            and torch.equal(got.detach().cpu().view(torch.uint8) if got.dim() else got.detach().cpu(),
                            want.view(torch.uint8) if want.dim() else want)
        return [] if ok else [path]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def rewrite_as_v2(ck: str, parts: int = 2) -> None:
    """Turn a plain full-tensor fastckpt checkpoint into format 2 as a DTensor save would write it:
    every tensor with a dim 0 of at least ``parts`` gets ``chunks`` of a ``torch.chunk(parts)`` split
    along dim 0 (FSDP2's layout) with their xxh3, instead of its whole-tensor ``xxh3``."""
    import json
    import os

    import xxhash
    from safetensors import safe_open
    mpath = os.path.join(ck, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    for key, e in m["tensors"].items():
        if "file" not in e or len(e["shape"]) == 0 or e["shape"][0] < parts:
            continue
        with safe_open(os.path.join(ck, e["file"]), "pt") as f:
            full = f.get_tensor(e["name"])
        chunks, start = [], 0
        for piece in torch.chunk(full, parts):
            off = [start] + [0] * (full.dim() - 1)
            chunks.append({"offsets": off, "shape": list(piece.shape),
                           "xxh3": xxhash.xxh3_64(piece.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()})
            start += piece.shape[0]
        del e["xxh3"]
        e["chunks"] = chunks
    m["format_version"] = 2
    with open(mpath, "w") as f:
        json.dump(m, f)
