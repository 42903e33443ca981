"""The before-``vllm serve`` effect: ``fastckpt load --warm`` then ``safetensors.load_file`` vs cold ``load_file``.

mmap-based readers (safetensors, and vLLM's default loader) fault pages in one by one; on
shared storage that is far below the tier's bandwidth. ``fastckpt load --warm`` reads the files
with parallel sequential reads first, so the mmap reader then finds every page in memory.

Each trial starts with a cold page cache (``sync; echo 3 > /proc/sys/vm/drop_caches`` when run
as root, else ``posix_fadvise(DONTNEED)`` on the files, which also evicts them). Reported, as
ratios (DESIGN.md: absolute seconds are noise on shared machines):

- ``raw``: one sequential large-block read of the same bytes (the tier's bandwidth);
- ``cold``: ``safetensors.torch.load_file`` on a cold cache;
- ``warm``: ``fastckpt load DIR --warm`` (CLI, separate process, interpreter start included),
  then ``load_file`` timed alone and together with the warm; ``warm_io``: the same parallel
  sequential reads in process (I/O only). Target: ``cold / load_after_warm >= 3``.

Usage: ``python benchmarks/bench_serve.py [--gib 2] [--shards 2] [--dir DIR] [--trials 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def make_model(folder: str, gib: float, shards: int) -> list[str]:
    """Write ``shards`` safetensors files holding ``gib`` GiB of random bf16 (reused if present)."""
    per = int(gib * (1 << 30)) // shards
    rows = per // (4096 * 2 * 8)
    paths = []
    for s in range(shards):
        p = os.path.join(folder, f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
        paths.append(p)
        if not os.path.exists(p):
            g = torch.Generator().manual_seed(s)
            save_file({f"layer{s}.w{i}": torch.randn(rows, 4096, generator=g).to(torch.bfloat16) for i in range(8)},
                      p, metadata={"format": "pt"})
    return paths


def drop_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns how."""
    if C.drop_caches():
        return "drop_caches"
    for p in paths:  # not root: per-file eviction
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def raw_read_s(paths: list[str], block: int = 16 << 20) -> float:
    buf = bytearray(block)
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def load_all_s(paths: list[str]) -> float:
    t = time.perf_counter()
    for p in paths:
        sd = load_file(p)
        for v in sd.values():  # touch every page, as a model copy would
            v.reshape(-1).view(torch.uint8)[::4096].sum()
        del sd
    return time.perf_counter() - t


def warm_s(folder: str, threads: int | None) -> float:
    cmd = [sys.executable, "-m", "fastckpt.cli.main", "load", folder, "--warm", "-q"]
    if threads:
        cmd += ["--threads", str(threads)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder on the storage under test (default: a temp folder)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    folder = a.dir or tempfile.mkdtemp(prefix="fastckpt-bench-serve-")
    os.makedirs(folder, exist_ok=True)
    paths = make_model(folder, a.gib, a.shards)
    nbytes = sum(os.path.getsize(p) for p in paths)
    from fastckpt.saving.export import warm_files
    res: dict[str, list[float]] = {"raw": [], "cold": [], "warm": [], "warm_io": [], "load_after_warm": []}
    how = ""
    for _ in range(a.trials):
        how = drop_cache(paths)
        res["raw"].append(raw_read_s(paths))
        drop_cache(paths)
        res["cold"].append(load_all_s(paths))
        drop_cache(paths)
        res["warm"].append(warm_s(folder, a.threads))  # the CLI, interpreter start included
        res["load_after_warm"].append(load_all_s(paths))
        drop_cache(paths)
        t = time.perf_counter()
        warm_files(paths, threads=a.threads)  # the same reads in process: I/O only
        res["warm_io"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in res.items()}
    gbps = {k: round(nbytes / v / 1e9, 3) for k, v in med.items()}
    out = {"bytes": nbytes, "files": len(paths), "cache_drop": how, "GBps": gbps,
           "warm_io_vs_raw": round(med["raw"] / med["warm_io"], 2),
           "cold_over_load_after_warm": round(med["cold"] / med["load_after_warm"], 2),
           "cold_over_warm_plus_load": round(med["cold"] / (med["warm"] + med["load_after_warm"]), 2)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
